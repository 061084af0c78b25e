"""FP8 E4M3 through llm-compressor, saved as compressed-tensors `float-quantized`.

fp8-dynamic: per-channel weight scales, dynamic per-token activation scales; needs no data.
fp8-static:  per-channel weight scales, one static activation scale per tensor from calibration.
fp8-block:   one weight scale per 128x128 block, dynamic activation scales per token and group of 128
             (llm-compressor's FP8_BLOCK preset, as DeepSeek-V3 and Qwen3 ship FP8); needs no data.
             vLLM's block kernels need every quantized layer's widths divisible by 128
             (`block_shape_problem`): a layer that is not is refused before any work, by name.

Two paths, one output. fp8-dynamic needs no forward, so it runs model-free where that is exact
(quantkit.engines.llmcompressor.model_free: the checkpoint read a slab of one weight at a time, the model never
loaded); fp8-static, and models whose checkpoint is more than a renaming of the transformers model
(MoE experts fused on load, custom code, extra tensors), load the model and run `oneshot`. fp8-block on a
mixture-of-experts checkpoint of a family with an expert layout row (Qwen3-MoE, DeepSeek-V3:
quantkit.arch.moe.EXPERT_CHECKPOINTS) runs model-free by checkpoint names
(quantkit.engines.llmcompressor.model_free_moe): neither the model's RAM nor a GPU.
`path_blocker` says which, before any work (the preflight and `quantkit inspect` use it), and
`model_free.plan_stream` checks the rest on the meta-device model; the report's `details.path`
names the path taken and why.

`fallback` (gate-driven, quantkit.run.pipeline.run_fallback): the Linear layers whose FP8 weights and
activations are predicted to cost the most (quantkit.mixed.layers: the weight's and the per-token
activation's rounding error, scaled by KL divergences measured on a few probe layers) stay 16-bit, a
few more each step, until the gate passes or `max_size` is spent.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.arch import moe
from quantkit.engines.llmcompressor import layer_resume, llmc, model_free
from quantkit.errors import UnsupportedError
from quantkit.formats import compressed_tensors
from quantkit.methods import (
    AutoRung,
    FallbackSteps,
    Layers,
    MethodSpec,
    ModelHandle,
    OnRanks,
    QuantizeJob,
    QuantizeResult,
    Resume,
    Sizes,
    Towers,
    fixed_gate,
)
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import Fallback

BLOCK = compressed_tensors.FP8_BLOCK  # fp8-block: the weight block (rows and columns) and activation group
# FP8 E4M3 is near-lossless on trained models: hold it to a tight gate.
DEFAULT_GATE = {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scheme: Literal["fp8-dynamic", "fp8-static", "fp8-block"] = "fp8-dynamic"
    quantize_lm_head: bool = False
    fallback: Fallback | None = None  # on a failed gate, keep the most damaging layers 16-bit (quantkit.mixed.budget)
    kv_cache: llmc.KvCache = None  # fp8: calibrated per-layer FP8 k/v scales (llmc.kv_cache_scheme)
    rotate: llmc.Rotate = "none"  # rotate before quantizing: hadamard | spinquant (llmc.rotation_modifiers)


def needs_calibration(options: Options) -> bool:
    """fp8-static's activation scales, a KV-cache scheme's k/v scales, and a fallback's sensitivity pass."""
    return options.scheme == "fp8-static" or options.kv_cache is not None or options.fallback is not None


PRECISIONS = {"fp8-dynamic": "fp8-e4m3 W/channel A/token", "fp8-static": "fp8-e4m3 W/channel A/static",
              "fp8-block": f"fp8-e4m3 W/block{BLOCK}x{BLOCK} A/token-group{BLOCK}"}


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role in ("decoder", "other") or (role == "lm_head" and options.quantize_lm_head):
        if options.scheme == "fp8-static" and re.search(r"\.experts\.\d+\.", name):  # scheme_config's experts
            return "fp8-e4m3 W/tensor A/static" + llmc.kv_suffix(options)
        return PRECISIONS[options.scheme] + llmc.kv_suffix(options)
    return None


# fp8-static's activation scale: the largest magnitude over every calibration window (compressed-tensors' FP8 preset's
# observer). Its statistics are a minimum and a maximum, which torchrun ranks reduce exactly (MIN/MAX): the scales
# on ranks are the one-process scales. (llm-compressor's default "minmax" is a moving average, weighted towards the
# first windows seen, which ranks can only average.)
OBSERVER = "static_minmax"


# a routed expert's projection, by llm-compressor's linear name and by the checkpoint's (Mixtral's w1): the module
# names compressed-tensors matches while quantizing and vLLM matches while loading (`<experts>.0.<ckpt name>`)
EXPERT_PROJECTION = r"re:.*\.experts\.\d+\.[^.]+$"


def scheme_config(options: Options, experts: bool = False) -> dict:
    """The config groups: fp8 weights per channel, activations per token (fp8-dynamic) or with one static scale per
    tensor (fp8-static); fp8-block's. On a mixture of experts (`experts`) fp8-static's expert projections have one
    weight scale per tensor: vLLM 0.32's fused-MoE fp8 method loads static activation scales only so (its
    CompressedTensorsW8A8Fp8MoEMethod asserts block scales otherwise), a regex target taking them before "Linear"."""
    if options.scheme == "fp8-block":
        return block_scheme_config()
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    if options.scheme == "fp8-static":
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                       "strategy": "tensor", "observer": OBSERVER}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    if not (experts and options.scheme == "fp8-static"):
        return {"group_0": group}
    # the experts' group first: compressed-tensors warns of a target no module matched first in this order
    per_tensor = {"targets": [EXPERT_PROJECTION], "weights": {**weights, "strategy": "tensor"},
                  "input_activations": activations}
    return {"group_0": per_tensor, "group_1": group}


# ---------------------------------------------------------------- fp8-block


def block_scheme_config() -> dict:
    """llm-compressor's FP8_BLOCK preset (compressed-tensors 0.19) as config groups: fp8 weights with one
    scale per 128x128 block, fp8 input activations with a dynamic scale per token and group of 128."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block",
               "block_structure": [BLOCK, BLOCK]}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                   "group_size": BLOCK}
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}


def block_shape_problem(name: str, shape: list[int]) -> str | None:
    """Why vLLM's FP8 block kernels cannot serve this Linear ([out, in]), None when they can: the output
    width of each fused part (q/k/v, gate/up) must be a multiple of the 128-row block, and the input
    width a multiple of the 128-column block and activation group (vLLM fp8_utils.validate_fp8_block_shape,
    per-token-group activation quantization)."""
    out, width = shape
    bad = [f"{label} {size}" for label, size in (("output width", out), ("input width", width)) if size % BLOCK]
    return f"{name}: {' and '.join(bad)} not a multiple of {BLOCK}" if bad else None


def shape_problems(info, options: Options, ignore: list[str]) -> dict[str, str]:
    """fp8-block: every Linear the target quantizes, the run's ignore list left out, whose widths vLLM's
    block kernels cannot take, with why."""
    if options.scheme != "fp8-block":
        return {}
    roles = ("decoder", "other", "lm_head") if options.quantize_lm_head else ("decoder", "other")
    found = {name: block_shape_problem(name, list(shape))
             for name, shape in intmix.quantized_layers(info, ignore, roles).items()}
    return {name: f"{why} (vLLM's FP8 block kernels need both)" for name, why in found.items() if why}


# What a scheme would store per MoE expert that transformers cannot reload into fused experts (not tried:
# refused until a test shows the reload)
def moe_model_free(info, options: Options) -> bool:
    """fp8-block on an MoE checkpoint with an expert layout row: quantized model-free, by checkpoint names."""
    return (options.scheme == "fp8-block" and bool(moe.expert_count(info.config))
            and moe.expert_checkpoint(info.model_type) is not None)


def check(info, options: Options, calibration) -> None:
    if moe_model_free(info, options):
        from quantkit.engines.llmcompressor import model_free_moe

        model_free_moe.check(info, "fp8", {"--kv-cache": options.kv_cache is not None,
                                           "--rotate": options.rotate != "none",
                                           "--fallback": options.fallback is not None})
        return
    moe.check_supported(info, "fp8")
    if options.scheme in EXPERT_RELOAD_REFUSED:
        moe.check_vlm_expert_reload(info, "fp8", EXPERT_RELOAD_REFUSED[options.scheme], "use --scheme fp8-dynamic")
    llmc.check_rotation(info, options.rotate, "fp8")
    if options.fallback is not None and options.scheme == "fp8-block":
        raise UnsupportedError("fp8: --fallback is not available with fp8-block yet (its sensitivity simulation "
                               "covers per-channel weights only)", hint="use --scheme fp8-dynamic with --fallback, "
                               "or keep layers 16-bit with --ignore")
    if options.fallback is not None:
        from quantkit.mixed.budget import check_max_size

        intmix.check_streamable(info, "fp8: fallback", "--fallback")
        layers = intmix.quantized_layers(info, [])
        check_max_size(options.fallback, intmix.artifact_estimate(info, layers, layer_bytes, PRECISION), "fp8 fallback")


def keeps_lm_head(options: Options) -> bool:
    return not options.quantize_lm_head


# A target's `vision`/`projector` int8/int4 (llmc.tower_modifiers) needs the loaded model: oneshot.
TOWERS_BLOCKER = "towers quantized on request go through oneshot"


def path_blocker(info, options: Options) -> str | None:
    """Why this target needs the model loaded (the oneshot path); None: the model-free path."""
    if moe_model_free(info, options):
        return None
    if options.scheme == "fp8-static":
        return "fp8-static calibrates activation scales on the loaded model"
    if options.scheme == "fp8-block":
        return "fp8-block's 128x128 weight blocks are quantized on the loaded model"
    if options.kv_cache is not None:
        return "the KV-cache scales are calibrated on the loaded model"
    if options.rotate != "none":
        return "the rotation (llm-compressor's transform modifier) is applied to the loaded model"
    return model_free.config_blocker(info, options.quantize_lm_head)


def needs_model(info, options: Options) -> bool:
    return path_blocker(info, options) is not None


def working_set(info, options: Options) -> int:
    """The model-free path's slabs (quantkit.engines.llmcompressor.model_free); 0 on the oneshot path."""
    if moe_model_free(info, options):
        from quantkit.engines.llmcompressor import model_free_moe
        from quantkit.methods import ignore_patterns

        return model_free_moe.working_set_bytes(info, ignore_patterns(info, [], keeps_lm_head(options)), whole=False)
    return 0 if needs_model(info, options) else model_free.working_set_bytes(info)


def support(family) -> str:
    if moe.expert_checkpoint(family.model_type) and not family.is_vlm:
        return "✅ every scheme; fp8-block model-free"
    if family.expert_reload_refusal(""):  # a VLM's experts: what transformers' reload decompresses
        return family.decoder_support("✅ fp8-dynamic (the block and static scales refused in its experts)")
    return family.decoder_support("✅ every scheme")


# what a scheme stores per expert that transformers' reload cannot decompress into fused experts (a VLM's, whose
# towers are proven on that reload: quantkit.arch.moe.check_vlm_expert_reload)
EXPERT_RELOAD_REFUSED = {"fp8-block": "fp8-block's 128x128 weight block scales",
                         "fp8-static": "fp8-static's input scales"}


def modifier(options: Options, ignore: list[str], experts: bool = False):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(config_groups=scheme_config(options, experts), ignore=ignore,
                                kv_cache_scheme=llmc.kv_cache_scheme(options.kv_cache))


def quantize(job: QuantizeJob) -> QuantizeResult:
    """Model-free where path_blocker and the meta-model plan allow it; else oneshot on the loaded model
    (loaded here when the pipeline did not: the plan found what the cheap check could not see)."""
    from quantkit.engines.transformers import torch_dtype

    if moe_model_free(job.info, job.options):
        from compressed_tensors.quantization import QuantizationScheme

        from quantkit.engines.llmcompressor import model_free_moe

        scheme = QuantizationScheme(**block_scheme_config()["group_0"])
        return QuantizeResult(job.out_dir, model_free_moe.quantize(job, scheme))
    blocker = TOWERS_BLOCKER if job.towers else path_blocker(job.info, job.options)
    if blocker is None:
        plan = model_free.plan_stream(job.info, torch_dtype(job.dtype, job.info), modifier(job.options, job.ignore),
                                      job.trust_remote_code)
        if isinstance(plan, model_free.StreamPlan):
            save_model_free(job, plan)
            return QuantizeResult(job.out_dir, {"path": "model-free"})
        blocker = plan
        if job.resume_dir is not None and not needs_calibration(job.options):  # found on the meta model only
            raise UnsupportedError(f"fp8: --resume needs the model-free path, and this model takes oneshot ({blocker})",
                                   hint="run without --resume")
        job.load_model(job.offload)  # freed by the pipeline
    details = llmc.calibration_details(job) if needs_calibration(job.options) else {}
    experts = moe.moe_layout(job.info.config) is not None
    llmc.run_oneshot(job, modifier(job.options, llmc.decoder_ignore(job), experts),
                     calibrate=needs_calibration(job.options))
    llmc.save_compressed(job)
    return QuantizeResult(job.out_dir, {"path": f"oneshot: {blocker}", **details})


def resume_refused(info, options: Options) -> str | None:
    """--resume: the model-free path saves its progress a shard at a time, a calibrated scheme (fp8-static, a KV
    cache) a layer at a time (quantkit.engines.llmcompressor.layer_resume); why these options do neither."""
    blocker = path_blocker(info, options)
    if blocker is None:
        return None
    if needs_calibration(options):
        return layer_resume.refused(options)
    return f"it quantizes this model with llm-compressor's oneshot, which calibrates nothing layer by layer ({blocker})"


def resume_bytes(info, options: Options, calibration) -> int:
    """The model-free path's state file (a sha256 per shard), or a calibrated scheme's saved layers."""
    if not needs_calibration(options):
        return 4096
    return layer_resume.saved_bytes(info, calibration.num_samples, calibration.seq_len)


def save_model_free(job: QuantizeJob, plan) -> None:
    """The model-free artifact: the weights, config.json and recipe.yaml as oneshot's save writes them."""
    from quantkit.engines.transformers import device_map, load_tokenizer

    if not job.ranks.is_main:  # under torchrun rank 0 writes alone: nothing is calibrated, nothing to share
        return
    state = None if job.resume_dir is None else job.resume_dir / "shards.json"
    if state is not None:
        state.parent.mkdir(parents=True, exist_ok=True)
    model_free.write_weights(plan, job.out_dir, device_map(job.device), state=state, progress=job.progress)
    model_free.write_config(plan, job.out_dir)
    model_free.write_generation_config(plan, job.info.path, job.out_dir)
    model_free.write_recipe(plan.modifier, job.info.path, job.out_dir)
    llmc.finish_artifact(job.out_dir, load_tokenizer(job.info, job.trust_remote_code), job.ignore)


# ---------------------------------------------------------------- gate-driven fallback

PRECISION = "fp8"  # the one precision of the fallback ladder below 16-bit


def layer_bytes(shape: tuple[int, int], precision: str, element: int = 2) -> int:
    """A Linear's stored bytes: fp8 weight and a per-channel scale, or the model's dtype (`element` bytes per
    value); plus the room a layer's name takes in the ignore list and the header."""
    out, inp = shape
    return (out * inp + out * element if precision == PRECISION else out * inp * element) + intmix.METADATA_BYTES


def simulation(options: Options) -> intmix.Simulation:
    """FP8 of one layer, simulated with compressed-tensors' rounding: its weight per channel, its input per
    token (fp8-dynamic) or with one scale (fp8-static)."""
    from compressed_tensors.quantization import QuantizationArgs

    group = scheme_config(options)["group_0"]
    weights, activations = QuantizationArgs(**group["weights"]), intmix.activation_quantizer(group["input_activations"])
    return intmix.Simulation((PRECISION,), lambda layer, precision, weight: intmix.rtn(weight, weights),
                             lambda layer, precision: activations)


def fallback_ladder(job: QuantizeJob, result: QuantizeResult):
    return intmix.keep_ladder(job, intmix.quantized_layers(job.info, job.ignore), simulation(job.options),
                              intmix.sized(layer_bytes, job))


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """The artifact again with the plan's 16-bit layers added to the ignore list."""
    import dataclasses
    from contextlib import nullcontext

    kept = dataclasses.replace(job, ignore=job.ignore + intmix.kept_16bit(plan), handle=ModelHandle())
    llmc.clear_weights(job.out_dir)
    with llmc.reloaded_model(kept) if needs_model(job.info, job.options) else nullcontext():
        result = quantize(kept)
    kept.free_model()  # quantize may have loaded it (the oneshot path found late)
    return QuantizeResult(result.artifact, {**details, **result.details,
                                            "mixed_precision": intmix.keep_report(details, plan,
                                                                                 intmix.sized(layer_bytes, job))})


def scheme(options: Options) -> str:
    return options.scheme  # fp8-dynamic, fp8-static or fp8-block, as compressed-tensors names them


AUTO_RUNGS = (AutoRung("fp8 W8A8 (FP8 dynamic)", (("scheme", "fp8-dynamic"),)),)  # --method auto (quantkit.run.auto)

METHOD = MethodSpec(
    name="fp8", format=compressed_tensors.FORMAT, label="compressed-tensors (float-quantized, float8_e4m3fn)",
    scheme=scheme, engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision,
    default_gate=fixed_gate(DEFAULT_GATE), check=check, needs_calibration=needs_calibration, needs_model=needs_model,
    support=support,
    layers=Layers(keeps_lm_head=keeps_lm_head, shape_problems=shape_problems,
                  quantizes_fused_experts=llmc.quantizes_fused_experts),
    sizes=Sizes(working_set=working_set),
    fallback=FallbackSteps(fallback_ladder, requantize),
    resume=Resume("the last written shard on the model-free path, the last finished decoder layer when calibrating",
                  resume_refused, resume_bytes),
    ranks=OnRanks(),
    towers=Towers(quantizes=True),
    auto=AUTO_RUNGS,
)

