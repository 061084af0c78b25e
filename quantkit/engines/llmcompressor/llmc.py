"""Shared glue for the methods that run through llm-compressor (fp8, gptq, awq, smoothquant)."""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator, Literal

from quantkit.engines.patches import plain_writes
from quantkit.io.shards import SHARD_BYTES

ENGINE = "llmcompressor"
FORMAT = "compressed-tensors"
KvCache = Literal["fp8"] | None  # a method's `kv_cache` option: the KV cache's precision in the artifact


def kv_cache_scheme(kv_cache: str | None) -> dict | None:
    """compressed-tensors' kv_cache_scheme of a `kv_cache` option: fp8 = FP8 E4M3 keys and values with one
    static scale per attention layer for each, calibrated on the windows (vLLM reads k_scale / v_scale
    with --kv-cache-dtype fp8) from the largest magnitude over every window (static_minmax: a minimum and maximum,
    which torchrun ranks reduce exactly); None: no KV-cache quantization."""
    if kv_cache is None:
        return None
    return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
            "observer": "static_minmax"}


# A method's `rotate` option: the rotation llm-compressor applies before quantizing (rotation_modifiers).
Rotate = Literal["none", "hadamard", "spinquant"]


def rotation_modifiers(job) -> list:
    """llm-compressor's transform modifier for the target's `rotate` option, run before its quantization
    (compressed-tensors stores it as the checkpoint's transform config):
    hadamard:  QuIPModifier: each quantized Linear's input rotated by a random Hadamard matrix, its inverse
               fused into the weight and the rotation itself applied to the activations at run time
               (online: the transform's matrices are stored and the loader applies them; lm_head never,
               since vLLM's head takes no transform);
    spinquant: SpinQuantModifier R1 + R2: random Hadamard rotations of the residual stream (the norms folded
               into the next Linears first) and of each attention head's values, all folded into the
               weights: nothing runs online and any loader computes the same model;
    none:      nothing."""
    rotate = getattr(job.options, "rotate", "none")
    if rotate == "hadamard":
        from llmcompressor.modifiers.transform import QuIPModifier

        ignore = list(dict.fromkeys([*decoder_ignore(job), "lm_head"]))
        return [QuIPModifier(rotations=["v"], transform_type="random-hadamard", ignore=ignore)]
    if rotate == "spinquant":
        from llmcompressor.modifiers.transform import SpinQuantModifier

        return [SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard")]
    return []


def rotation_ready(job) -> None:
    """SpinQuant unties tied embeddings and rotates both vocabulary tables; with them offloaded to disk (quantkit's
    CPU runs) compressed-tensors 0.19 cannot read the tied head (a KeyError in its disk cache), and under torchrun
    the other ranks read the tables' files while rank 0 rewrites them (quantkit.engines.llmcompressor.one_writer;
    a SafetensorError "header too small" in one launch of two on gloo), so the model is loaded again with the
    tables in memory (shared by the ranks of a node). With every decoder layer on disk too (--offload-dir) that
    would load the whole model: refused (exit 2)."""
    from quantkit.errors import UnsupportedError

    tied = getattr(job.model.config.get_text_config(), "tie_word_embeddings", False)
    if getattr(job.options, "rotate", "none") != "spinquant" or job.offload is None or not (
            tied or job.ranks.distributed):
        return
    if job.offload.layers:
        raise UnsupportedError("--rotate spinquant with --offload-dir: SpinQuant unties and rotates this model's tied "
                               "embeddings, which compressed-tensors cannot read from the disk offload",
                               hint="drop --offload-dir, or use --rotate hadamard")
    job.progress("spinquant: loading the model again with its vocabulary tables in memory (SpinQuant rotates them)")
    job.free_model()
    job.load_model(None)


def check_rotation(info, rotate: str, method: str) -> None:
    """Before any work: a rotation llm-compressor cannot build for this model refused (UnsupportedError, exit 2)."""
    from quantkit.errors import UnsupportedError

    if rotate == "spinquant" and info.towers.components:
        raise UnsupportedError(f"{method}: --rotate spinquant is refused for a vision-language model: SpinQuant's "
                               "mappings match every q/k/v/o and MLP projection by name, the towers' too",
                               hint="use --rotate hadamard (the quantized decoder Linears only)")
    unbuilt = sorted(size for size in rotation_sizes(info, rotate) if not hadamard_size(size))
    if unbuilt:
        raise UnsupportedError(f"{method}: --rotate {rotate}: compressed-tensors has no random Hadamard matrix of "
                               f"size {unbuilt[0]} (it builds a power of two times one of its known orders)",
                               hint="use --rotate none" + (" or spinquant" if rotate == "hadamard" else ""))


def rotation_sizes(info, rotate: str) -> set[int]:
    """The widths the rotation's Hadamard matrices take: every quantized decoder Linear's input (hadamard), the
    hidden size and the head width (spinquant)."""
    from quantkit.arch.roles import classify, linear_weights

    if rotate == "hadamard":
        return {shape[1] for name, shape in linear_weights(info).items()
                if classify(name + ".weight", info.towers) in ("decoder", "other")}
    if rotate == "spinquant":
        text = info.config.get("text_config") or info.config
        hidden = text["hidden_size"]
        return {hidden, text.get("head_dim") or hidden // text["num_attention_heads"]}
    return set()


def hadamard_size(size: int) -> bool:
    """Whether compressed-tensors builds a random Hadamard matrix of this order: a power of two times one of
    the known orders it ships (transform/utils/hadamards.safetensors)."""
    from compressed_tensors.transform.utils.hadamard import REPO_PATH, is_pow2
    from safetensors import safe_open

    with safe_open(REPO_PATH, framework="pt") as known:
        orders = [int(key) for key in known.keys()]  # noqa: SIM118  (a safetensors file, not a dict)
    return is_pow2(size) or any(size % k == 0 and is_pow2(size // k) for k in orders)


def kv_suffix(options) -> str:
    """The precision plan's words for a `kv_cache` option."""
    return " + KV fp8 (calibrated per layer)" if getattr(options, "kv_cache", None) else ""


def quantizes_fused_experts(info, options) -> bool:
    """Layers.quantizes_fused_experts of every llm-compressor method: oneshot quantizes the experts a checkpoint
    stores fused wherever their family has an expert layout (they are linearized first, one Linear per expert
    projection: quantkit.arch.moe.linearize, or oneshot's own linearization: Llama 4, Granite 4)."""
    from quantkit.arch.moe import moe_layout

    return moe_layout(info.config) is not None


def run_oneshot(job, recipe, calibrate: bool, reads_weights_only: bool = False) -> None:
    """Apply llm-compressor modifiers to job.model in place (layer by layer when calibrating). GPTQ keeps
    one copy of each Hessian (quantkit.engines.llmcompressor.lean_hessian). Under torchrun each rank calibrates on
    its own share of the windows (quantkit.engines.llmcompressor.distributed). `reads_weights_only`: the recipe's modifiers
    never change an onloaded weight in place between forwards (GPTQ; not AWQ, whose grid search
    does), so a subgraph's weights need not stay onloaded (onloaded_per_forward)."""
    from llmcompressor import oneshot

    from quantkit.arch.moe import linearize
    from quantkit.engines.llmcompressor import lean_hessian
    from quantkit.engines.llmcompressor.distributed import synchronized
    from quantkit.engines.patches import OFFSET_NORMS, patched
    from quantkit.io.memory import map_large_allocations

    kwargs = {}
    if calibrate:
        map_large_allocations()
        share = job.ranks.share(len(job.windows.calib))  # all of them in one process
        kwargs = dict(
            dataset=job.windows.calib_dataset(share),
            num_calibration_samples=share.stop - share.start,
            max_seq_length=job.windows.calib.shape[1],
            shuffle_calibration_samples=False,
            pipeline="sequential",
            moe_calibrate_all_experts=True,  # every expert sees every token (quantkit.arch.moe)
            **sequential_options(job.info.config),
        )
    rotation_ready(job)
    linearize(job.model, job.info.config)  # the experts oneshot's linearization cannot build (Llama 4's text model)
    towers = tower_modifiers(job)
    if towers:  # data-free first: the sequential pipeline computes scales only for modules that run
        with patched(*OFFSET_NORMS):
            oneshot(model=job.model, recipe=towers, tokenizer=job.tokenizer, log_dir=None,
                    trust_remote_code_model=job.trust_remote_code)
    # plain writes: with --offload-dir every weight GPTQ updates is rewritten to disk (quantkit.io.shards)
    with (lean_hessian.lean_hessians(), synchronized(job.ranks), plain_writes(),
          onloaded_per_forward(job, reads_weights_only), patched("transform.offloaded_device", *OFFSET_NORMS),
          layers_saved(job, calibrate)):
        oneshot(model=job.model, recipe=rotation_modifiers(job) + as_list(recipe), tokenizer=job.tokenizer,
                log_dir=None, trust_remote_code_model=job.trust_remote_code, **kwargs)  # it re-reads config.json


def sequential_options(config: dict) -> dict:
    """oneshot's sequential_targets where the checkpoint's family names them (its record's `sequential`: Gemma 4
    with KV shared across layers calibrates its whole text model as one subgraph); {} for llm-compressor's
    default (one decoder layer per subgraph)."""
    from quantkit.arch.families import of_config
    from quantkit.arch.families.text import text_hparams

    family = of_config(config)
    targets = family.sequential(text_hparams(config)) if family is not None and family.sequential else None
    return {"sequential_targets": targets} if targets else {}


def layers_saved(job, calibrate: bool):
    """--resume: llm-compressor's layer-by-layer loop saving each finished layer in the target's saved progress
    and continuing after the last one saved (quantkit.engines.llmcompressor.layer_resume)."""
    from quantkit.engines.llmcompressor.layer_resume import LayerCheckpoints
    from quantkit.engines.patches import patched_with

    if job.resume_dir is None or not calibrate:
        return nullcontext()
    return patched_with("sequential.resume", checkpoints=LayerCheckpoints(Path(job.resume_dir) / "layers", job.progress,
                                                                          job.ranks))


def as_list(recipe) -> list:
    """A modifier or a list of them, as a list."""
    return list(recipe) if isinstance(recipe, (list, tuple)) else [recipe]


def reads_layers_per_forward(job) -> bool:
    """Decoder layers on disk and the CPU doing the work: --offload-dir on a machine without a GPU."""
    from quantkit.engines.transformers import device_map

    return job.offload is not None and job.offload.layers and device_map(job.device) == "cpu"


@contextmanager
def onloaded_per_forward(job, reads_weights_only: bool) -> Iterator[None]:
    """With reads_layers_per_forward and modifiers that only read the weights between forwards, each
    module's weight is read from disk for each forward and dropped after it, instead of a whole
    layer held onloaded for the time llm-compressor works on it.

    llm-compressor keeps a subgraph's weights for its calibration pass, its GPTQ step and its
    propagation pass (compressed-tensors' disable_offloading) to spare a GPU the same host-to-device
    copies batch after batch. On a CPU the onloaded copy is the disk copy read again: here it was a
    whole layer (116 MiB on the 1B benchmark model) resident beside the layer's Hessians, at the
    run's peak, for no saving but page-cache reads. GPTQ's own step still holds the one module it
    quantizes (its compress_module_list keeps its disable_offloading). AWQ's grid search writes trial
    scales into the onloaded weights (`weight.data.copy_`) and relies on them staying: it keeps
    llm-compressor's behaviour."""
    from quantkit.engines.patches import patched

    if not (reads_weights_only and reads_layers_per_forward(job)):
        yield
        return
    with patched("sequential.disable_offloading"):
        yield


def tower_linears(job) -> dict[str, list[str]]:
    """int8/int4 -> the Linear modules of the tower roles the target quantizes (job.towers). Linear
    subclasses (nn.MultiheadAttention's out_proj in SigLIP's pooling head) stay 16-bit: transformers
    cannot reload them quantized."""
    import torch

    from quantkit.arch.roles import TOWER_EMBEDDING, classify

    chosen: dict[str, list[str]] = {}
    if not job.towers:  # the rule: every tower stays 16-bit, nothing to look for
        return chosen
    for name, module in job.model.named_modules():
        role = classify(name, job.info.towers)
        if role in job.towers and type(module) is torch.nn.Linear and not TOWER_EMBEDDING.search(name):
            chosen.setdefault(job.towers[role], []).append(name)
    return chosen


def tower_group_size(widths: list[int]) -> int:
    """The largest of quantkit.arch.roles.TOWER_GROUP_SIZES dividing every input width; -1 (per channel) if none does."""
    from quantkit.arch.roles import TOWER_GROUP_SIZES

    return next((g for g in TOWER_GROUP_SIZES if all(w % g == 0 for w in widths)), -1)


def tower_modifiers(job) -> list:
    """Round-to-nearest weight-only quantization of the towers a target asks for (`vision`/`projector`),
    as its own config group, before the method's modifiers (text-only calibration never runs a tower,
    so GPTQ/AWQ could not calibrate them)."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from quantkit.arch.roles import TOWER_BITS

    groups = {}
    for precision, names in tower_linears(job).items():
        widths = [job.model.get_submodule(n).in_features for n in names]
        group_size = -1 if precision == "int8" else tower_group_size(widths)
        groups[f"towers_{precision}"] = {"targets": names, "weights": weight_args(TOWER_BITS[precision], group_size, True)}
    return [QuantizationModifier(config_groups=groups)] if groups else []


def decoder_ignore(job) -> list[str]:
    """The method's own modifiers' ignore list: the target's, plus the tower modules tower_modifiers quantizes."""
    return job.ignore + [name for names in tower_linears(job).values() for name in names]


def calibration_details(job) -> dict:
    """Report fields of a calibrated method: the calibration tokens, and for an MoE model the tokens
    routed to each expert (counted before quantization, quantkit.arch.moe)."""
    from quantkit.arch.moe import routing_details
    from quantkit.engines.transformers import device_map

    return {"calibration_tokens": int(job.windows.calib.numel()),
            **routing_details(job.model, job.info, job.windows.calib, device_map(job.device))}


def save_compressed(job) -> None:
    """compressed-tensors checkpoint + tokenizer into the staging directory (MoE experts under the
    checkpoint's tensor names, quantkit.arch.moe)."""
    from quantkit.arch.moe import moe_model_type, set_save_names

    set_save_names(job.model, moe_model_type(job.info.config))
    # bounded shards, each written with plain writes: safetensors maps the output file while it fills
    # it, so a whole shard's pages would count in the RSS beside the model (quantkit.io.shards.save_file)
    # under torchrun every rank compresses a share of the modules and rank 0 writes them
    with plain_writes():
        job.model.save_pretrained(job.out_dir, save_compressed=True, max_shard_size=SHARD_BYTES)
    if job.ranks.is_main:
        finish_artifact(job.out_dir, job.tokenizer, job.ignore)
    release_session()


def finish_artifact(out_dir, tokenizer, ignore: list[str]) -> None:
    """Beside a compressed-tensors checkpoint: the tokenizer, and the ignore list completed for
    transformers (the oneshot and the model-free paths alike)."""
    tokenizer.save_pretrained(out_dir)
    add_module_names_to_ignore(out_dir)  # so transformers, not only vLLM, reloads VLM artifacts right
    add_patterns_to_ignore(out_dir, ignore)  # every module of a kept tower, Linear subclasses too


def release_session() -> None:
    """llm-compressor keeps the last model in its global session; drop it so memory can be freed."""
    from llmcompressor.core import reset_session

    reset_session()



@contextmanager
def reloaded_model(job) -> Iterator[None]:
    """The full-precision model loaded again into the job's handle for the time inside, then freed
    (to_meta, as the pipeline frees it). A gate-driven fallback step needs it:
    llm-compressor quantized and compressed the previous model in place, and the pipeline freed it
    before measuring. What the first load put on disk goes to a fresh folder inside the target's,
    removed on exit."""
    import shutil
    import tempfile

    from quantkit.engines.transformers import Offload

    offload = None
    if job.offload is not None:
        offload = Offload(Path(tempfile.mkdtemp(prefix="reload-", dir=job.offload.folder)), job.offload.layers)
    try:
        job.load_model(offload)
        yield
    finally:
        release_session()
        job.free_model()
        if offload is not None:
            shutil.rmtree(offload.folder, ignore_errors=True)


def clear_weights(out_dir) -> None:
    """Remove the safetensors weights (and their index) of an earlier save from out_dir, so a re-save
    that shards differently leaves no stale shard behind."""
    for path in Path(out_dir).glob("*.safetensors"):
        path.unlink()
    for path in Path(out_dir).glob("*.safetensors.index.json"):
        path.unlink()


def weight_args(bits: int, group_size: int, symmetric: bool) -> dict:
    """compressed-tensors QuantizationArgs for static int weights."""
    args = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    if group_size == -1:
        return {**args, "strategy": "channel"}
    return {**args, "strategy": "group", "group_size": group_size}


# ---------------------------------------------------------------- the ignore list completed for transformers


def add_patterns_to_ignore(dest: Path, patterns: list[str]) -> list[str]:
    """Write the run's regex ignore entries into a compressed-tensors config's `ignore` list.

    compressed-tensors writes `ignore` as the plain `Linear` modules it skipped, by name; a Linear
    subclass inside a kept tower (nn.MultiheadAttention's `out_proj`, a
    NonDynamicallyQuantizableLinear in SigLIP's pooling head) is not listed, so transformers would
    build it as quantized on reload and look for scales that were never written. The regexes that
    kept each tower whole (quantkit.arch.vlm.ignore_pattern; `re:` is understood by compressed-tensors,
    transformers and vLLM) name every module under it. Returns the entries added.
    """
    config_file = dest / "config.json"
    config = json.loads(config_file.read_text())
    qconfig = config.get("quantization_config") or {}
    if qconfig.get("quant_method") != FORMAT:
        return []
    ignore = qconfig.get("ignore") or []
    added = [p for p in patterns if p.startswith("re:") and p not in ignore]
    if added:
        qconfig["ignore"] = ignore + added
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return added


def add_module_names_to_ignore(dest: Path) -> list[str]:
    """Make a compressed-tensors `ignore` list hold both checkpoint names and module names.

    compressed-tensors (>= 0.19) writes `ignore` in *checkpoint* names: it maps module names back
    through transformers' conversion mapping, as `save_pretrained` does for the weights (Llava:
    `model.vision_tower.X` -> `vision_tower.X`, `lm_head` -> `language_model.lm_head`). vLLM maps
    those names itself, but transformers matches `ignore` against the module names of the model it
    builds on reload without mapping them, so it would wrap the unquantized vision tower, projector
    and lm_head as quantized and read garbage scales (llm-compressor issue #3159). Adding each
    entry's module name (the forward mapping transformers applies when loading) serves both.
    Returns the names added; leaves the file alone when nothing is renamed.
    """
    config_file = dest / "config.json"
    if not config_file.is_file():
        return []
    config = json.loads(config_file.read_text())
    qconfig = config.get("quantization_config") or {}
    ignore = qconfig.get("ignore") or []
    names = [n for n in ignore if not n.startswith("re:")]
    if qconfig.get("quant_method") != FORMAT or not names:
        return []
    try:
        mapped = _checkpoint_to_module_names(dest, config, names)
    except Exception:  # transformers internals moved: keep the list as written; the gate still measures it
        return []
    added = [m for m in dict.fromkeys(mapped) if m not in ignore]
    if added:
        qconfig["ignore"] = ignore + added
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return added


def _checkpoint_to_module_names(dest: Path, config: dict, names: list[str]) -> list[str]:
    """The module name transformers gives each checkpoint name on load (a meta-device model, no weights)."""
    import torch
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from quantkit.engines.transformers import auto_model_class

    hf_config = AutoConfig.from_pretrained(dest, local_files_only=True, trust_remote_code=False)  # names only
    with torch.device("meta"):
        model = auto_model_class(config).from_config(hf_config)
    conversions = get_model_conversion_mapping(model)
    if not conversions:
        return []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = model.state_dict()
    modules = dict(model.named_modules())
    mapped = []
    for name in names:
        renamed, _ = rename_source_key(name + ".weight", renamings, converters, model.base_model_prefix, meta_state)
        renamed = renamed.removesuffix(".weight")
        if renamed != name and renamed in modules:
            mapped.append(renamed)
    return mapped
