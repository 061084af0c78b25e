"""Shared glue for the methods that run through llm-compressor (fp8, gptq, awq, smoothquant)."""

from __future__ import annotations

ENGINE = "llmcompressor"
FORMAT = "compressed-tensors"


def run_oneshot(job, recipe, calibrate: bool) -> None:
    """Apply llm-compressor modifiers to job.model in place (layer by layer when calibrating)."""
    from llmcompressor import oneshot

    kwargs = {}
    if calibrate:
        kwargs = dict(
            dataset=job.windows.calib_dataset(),
            num_calibration_samples=len(job.windows.calib),
            max_seq_length=job.windows.calib.shape[1],
            shuffle_calibration_samples=False,
            pipeline="sequential",
            moe_calibrate_all_experts=True,  # every expert sees every token (quantkit.methods.moe)
        )
    oneshot(model=job.model, recipe=recipe, tokenizer=job.tokenizer, log_dir=None,
            trust_remote_code_model=job.trust_remote_code, **kwargs)  # it re-reads config.json


def calibration_details(job) -> dict:
    """Report fields of a calibrated method: the calibration tokens, and for an MoE model the tokens
    routed to each expert (counted before quantization, quantkit.methods.moe)."""
    from quantkit.methods.moe import routing_details
    from quantkit.model import device_map

    return {"calibration_tokens": int(job.windows.calib.numel()),
            **routing_details(job.model, job.info, job.windows.calib, device_map(job.device))}


def save_compressed(job) -> None:
    """compressed-tensors checkpoint + tokenizer into the staging directory (MoE experts under the
    checkpoint's tensor names, quantkit.methods.moe)."""
    from quantkit.methods.moe import set_save_names

    set_save_names(job.model, job.info.model_type)
    job.model.save_pretrained(job.out_dir, save_compressed=True)
    finish_artifact(job.out_dir, job.tokenizer, job.ignore)
    release_session()


def finish_artifact(out_dir, tokenizer, ignore: list[str]) -> None:
    """Beside a compressed-tensors checkpoint: the tokenizer, and the ignore list completed for
    transformers (the oneshot and the model-free paths alike)."""
    from quantkit.export import add_module_names_to_ignore, add_patterns_to_ignore

    tokenizer.save_pretrained(out_dir)
    add_module_names_to_ignore(out_dir)  # so transformers, not only vLLM, reloads VLM artifacts right
    add_patterns_to_ignore(out_dir, ignore)  # every module of a kept tower, Linear subclasses too


def release_session() -> None:
    """llm-compressor keeps the last model in its global session; drop it so memory can be freed."""
    from llmcompressor.core import reset_session

    reset_session()

