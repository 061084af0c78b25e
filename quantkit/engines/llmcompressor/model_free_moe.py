"""Mixture-of-experts checkpoints quantized without a model object: what is quantized is decided from the
checkpoint's tensor names, a tensor (or a slab of one) at a time from the safetensors.

quantkit.engines.llmcompressor.model_free decides what to quantize on a transformers model built on the meta
device, which is exact only where the checkpoint is a renaming of that model; transformers 5 fuses MoE experts
while loading (quantkit.arch.moe), so an MoE checkpoint takes this path instead, as llm-compressor's own
`model_free_ptq` does (it matches checkpoint names, not modules). What vLLM loads is the reference:

- quantized: every 2-D `.weight` of the decoder (attention projections, dense MLPs, routed and shared experts) the
  run's ignore list does not keep, with llm-compressor's model-free observers and compressors:
  `ModelFreePtqConverter.process` for a weight alone, a slab of rows at a time where rows quantize independently
  (fp8-block's 128-row blocks, mxfp4's groups of 32 per row); the steps of its microscale path for the weights vLLM
  fuses into one layer under NVFP4 (`model_free.quantize_fused`: q/k/v, gate/up of a dense MLP, of each expert
  and of the shared experts, MLA's q_a/kv_a), so that they share one global scale as vLLM needs
  (`CompressedTensorsW4A4Nvfp4MoEMethod` keeps w1's and warns when w3's differs; the linear scheme takes the
  largest). llm-compressor's own model-free patterns fuse q/k/v and an MLP's gate/up but not an expert's, nor the
  shared experts', nor MLA's q_a/kv_a, which its oneshot path fuses (observers.helpers.FUSED_LAYER_NAMES): those
  are the groups used here;
- kept as stored (copied by the kernel, never read into memory; cast a slab at a time as from_pretrained casts
  them under --dtype): embeddings, norms, the routers (`mlp.gate`,
  DeepSeek-V3's float32 `e_score_correction_bias` with it), lm_head, biases, and the multi-token-prediction layers
  after the decoder's (DeepSeek-V3's `model.layers.<num_hidden_layers>.`: vLLM's draft model loads them; its
  `eh_proj` is a plain Linear there);
- config.json: the source's, with the quantization_config llm-compressor's model-free save writes
  (`save_utils.update_config`: one config group targeting `Linear`, the compressed format), its `ignore` every
  kept Linear by its full name (the routers, lm_head, what the run kept), the run's `re:` entries and each MTP
  layer as a `re:` prefix: what vLLM matches exactly or by `re:` (compressed_tensors/utils.py
  should_ignore_layer), and for the fused experts
  `<layer>.mlp.experts.0.{gate,up,down}_proj` (CompressedTensorsMoEMethod.get_moe_method), so every expert
  resolves to the group's scheme and every router to unquantized (Qwen3-MoE's GateLinear takes the quant config).

Peak memory: one slab (SLAB_BYTES of stored rows, SLAB_WORKING_SET times over), or one whole fused NVFP4 set (an
expert's gate and up; the q/k/v of one layer), whichever is larger; never the model. A weight under an NVFP4
scheme is quantized whole: its global scale is the largest magnitude over the whole matrix (and its fused
partners).

Workers: llm-compressor's model_free_ptq runs its shards in a pool of threads (max_workers, 1 by default) so that
several GPUs each take a shard, each job holding a whole input shard. quantkit's path runs on one device, where one
slab's quantization already uses every core (torch's intra-op threads on a CPU, the whole GPU otherwise) while the
next slab is read from disk (quantkit.io.readahead): a second worker would add a second working set and contend
for the same cores, so the shards are written one after another, and the memory bound stays one slab.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.arch import moe
from quantkit.arch.roles import classify, matches
from quantkit.errors import UnsupportedError
from quantkit.io.checkpoint import ModelInfo

# roles of the 2-D weights that are quantized unless ignored (quantkit.arch.roles): the decoder's linears, and
# lm_head when the run does not keep it
QUANTIZED_ROLES = ("decoder", "other", "lm_head")


def blocker(info: ModelInfo) -> str | None:
    """Why an MoE checkpoint cannot take this path, from config.json and the safetensors headers (no torch);
    None when it may."""
    if moe.expert_checkpoint(info.model_type) is None:
        known = ", ".join(sorted(moe.EXPERT_CHECKPOINTS))
        return f"its experts' checkpoint layout ({info.model_type}) has no row in quantkit.arch.moe (known: {known})"
    if info.is_quantized:
        return "the checkpoint is already quantized (give the 16-bit checkpoint)"
    if info.config.get("auto_map"):
        return "the model has custom modeling code"
    floats = ("BF16", "F16", "F32")
    odd = sorted(name for name, (dtype, _) in info.tensors.items() if dtype not in floats)
    if odd:
        return f"tensors stored as integers or fp8 ({odd[0]}, ...): give the 16-bit checkpoint"
    stacked = sorted(name for name, (_dtype, shape) in info.tensors.items() if len(shape) > 2)
    if stacked:
        return f"experts stored stacked ({stacked[0]}, {len(info.tensors[stacked[0]][1])}-D), not one tensor each"
    return None


def mtp_prefixes(info: ModelInfo) -> list[str]:
    return moe.mtp_prefixes(info.config, info.tensors, moe.expert_checkpoint(info.model_type))


def linear_modules(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """{module: weight shape} of every 2-D `.weight` but the embeddings' and the norms' (llm-compressor's
    model-free matching skips modules named like a norm), outside the MTP layers."""
    mtp = tuple(mtp_prefixes(info))
    found = {}
    for name, (_dtype, shape) in info.tensors.items():
        if not name.endswith(".weight") or len(shape) != 2 or name.startswith(mtp):
            continue
        module = name.removesuffix(".weight")
        if module.endswith("norm") or classify(name, info.towers) in ("embeddings", "norm"):
            continue
        found[module] = tuple(shape)
    return found


def quantized_modules(info: ModelInfo, ignore: list[str]) -> list[str]:
    """The modules whose weights are quantized: the linears of QUANTIZED_ROLES the ignore list (llm-compressor's
    matching, quantkit.arch.roles.matches) does not keep; routers never. Checkpoint order."""
    return [m for m in linear_modules(info)
            if classify(m + ".weight", info.towers) in QUANTIZED_ROLES and not matches(m, ignore)]


def written_ignore(info: ModelInfo, ignore: list[str], quantized: list[str]) -> list[str]:
    """The quantization_config's `ignore`: every kept linear by its full name (what vLLM and compressed-tensors
    match exactly: the routers, lm_head, what the run kept), the run's `re:` entries, and each MTP layer as a `re:`
    prefix."""
    done = set(quantized)
    named = sorted(m for m in linear_modules(info) if m not in done)
    return named + [p for p in ignore if p.startswith("re:")] + [f"re:{re.escape(p)}.*" for p in mtp_prefixes(info)]


def split_fused(info: ModelInfo, quantized: list[str]) -> dict[str, str]:
    """{quantized module: why} for each shard of a layer vLLM fuses (quantkit.arch.fused: q/k/v, gate/up, MLA's
    q_a/kv_a) that would be quantized while another shard stays 16-bit: vLLM refuses a fused layer whose shards'
    schemes differ."""
    from quantkit.arch.fused import split_groups

    done = set(quantized)
    modules = list(linear_modules(info))
    return split_groups([m for m in modules if m not in done], modules)


def fused_sets(modules: list[str], fused_names) -> list[tuple[str, ...]]:
    """The sets of sibling modules that share one global scale (`fused_names`: llm-compressor's
    FUSED_LAYER_NAMES, e.g. ("gate_proj", "up_proj")), each in that order, every member among `modules`."""
    present = set(modules)
    sets = []
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        for names in fused_names:
            members = tuple(f"{parent}.{n}" for n in names)
            if leaf == names[0] and all(m in present for m in members):
                sets.append(members)
    return sets


# ------------------------------------------------------------------ the plan (torch from here on)


@dataclass
class MoePlan:
    items: list  # model_free.Copied | Quantized | FusedQuantized, in checkpoint file order
    config: Any  # compressed_tensors QuantizationConfig written into config.json
    modifier: Any  # llm-compressor QuantizationModifier of the same scheme (recipe.yaml)
    dtype: str | None = None  # config.json's dtype when the run loads the model in another (--dtype)


def model_free_config(scheme, ignore: list[str]):
    """llm-compressor's model-free QuantizationConfig of one scheme over `Linear` (validate.validate_config: the
    observers it substitutes for a data-free run), its format set as compressed-tensors infers it for a Linear."""
    import torch
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    from llmcompressor.entrypoints.model_free.validate import validate_config

    scheme = scheme.model_copy(deep=True)
    scheme.targets = ["Linear"]
    config = validate_config(QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)), None, [])
    for group in config.config_groups.values():
        if group.format is None:
            group.format = infer_module_format(torch.nn.Linear, group).value
    return config


def fp32_modules(info: ModelInfo) -> list[str]:
    """Module names transformers keeps in float32 whatever dtype it loads the model in (the model class's
    `_keep_in_fp32_modules_strict` and `_keep_in_fp32_modules`: DeepSeek-V3's e_score_correction_bias), read from
    the class without building it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**info.config)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    return [*(getattr(cls, "_keep_in_fp32_modules_strict", None) or []), *(getattr(cls, "_keep_in_fp32_modules", None) or [])]


def load_dtype(name: str, stored: str, dtype, keep_fp32: list[str]) -> str:
    """The safetensors dtype a kept tensor is written in when the model is loaded in `dtype` (a torch dtype), as
    from_pretrained casts it: floating tensors to `dtype`, but those of keep_fp32 modules (float32) and integers."""
    from quantkit.io.shards import safetensors_dtype

    if stored not in ("BF16", "F16", "F32"):
        return stored
    return "F32" if any(k in name.split(".") for k in keep_fp32) else safetensors_dtype(dtype)


def plan_moe(info: ModelInfo, scheme, ignore: list[str], dtype=None) -> MoePlan:
    """The model-free plan of an MoE checkpoint (no `blocker`) under one compressed-tensors QuantizationScheme, the
    run's ignore list kept 16-bit; `dtype` (a torch dtype; None: as stored) is the one the weights are quantized
    in and the kept floating tensors are written in, as from_pretrained would load them."""
    import torch
    from llmcompressor.entrypoints.model_free.microscale import is_microscale_scheme
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.observers.helpers import FUSED_LAYER_NAMES

    from quantkit.engines.llmcompressor.model_free import Copied, fused_item, quantized_item
    from quantkit.io.checkpoint import SafetensorsWeights
    from quantkit.io.safetensors import TORCH_DTYPES

    why = blocker(info)
    if why:
        raise UnsupportedError(f"the model-free MoE path cannot read {info.path}: {why}",
                               hint="give a 16-bit safetensors checkpoint of a supported MoE family")
    quantized = quantized_modules(info, ignore)
    config = model_free_config(scheme, written_ignore(info, ignore, quantized))
    scheme = next(iter(config.config_groups.values()))
    split = split_fused(info, quantized)
    if split:
        name, problem = next(iter(sorted(split.items())))
        raise UnsupportedError(f"{name} would be quantized, but {problem}",
                               hint=f"keep the whole group 16-bit (--ignore {name} too) or none of it")
    sets = fused_sets(quantized, FUSED_LAYER_NAMES) if is_microscale_scheme(scheme) else []
    stored = SafetensorsWeights(info.path).index
    keep_fp32 = fp32_modules(info) if dtype is not None else []
    plans = {}  # (shapes, dtype) -> an item planned on the meta device: the others of those shapes are renamings

    def planned(modules: tuple[str, ...], entries: tuple, loaded):
        key = (tuple(e.shape for e in entries), loaded)
        if key not in plans:
            plans[key] = (fused_item(modules, entries, loaded, scheme) if len(modules) > 1
                          else quantized_item(modules[0], entries[0], loaded, scheme))
        return renamed(plans[key], modules, entries)

    in_set = {m: s for s in sets for m in s}
    items, done = [], set()
    by_weight = {f"{m}.weight": m for m in quantized}
    for name, entry in sorted(stored.items(), key=lambda kv: (str(kv[1].file), kv[1].offset)):
        module = by_weight.get(name)
        if module is None:
            items.append(Copied(name, entry, entry.dtype if dtype is None else load_dtype(name, entry.dtype, dtype,
                                                                                            keep_fp32)))
            continue
        loaded = dtype or getattr(torch, TORCH_DTYPES[entry.dtype])
        group = in_set.get(module)
        if group is None:
            items.append(planned((module,), (entry,), loaded))
        elif group not in done:
            done.add(group)
            items.append(planned(group, tuple(stored[f"{m}.weight"] for m in group), loaded))
    modifier = QuantizationModifier(config_groups={"group_0": scheme.model_copy(deep=True)}, ignore=list(config.ignore))
    return MoePlan(items, config, modifier, None if dtype is None else str(dtype).removeprefix("torch."))


def renamed(item, modules: tuple[str, ...], entries: tuple):
    """A planned Quantized or FusedQuantized for other modules of the same shapes (the converter and the outputs'
    dtypes and shapes are the same; planning each of a model's thousands of experts on the meta device would cost
    a converter run each)."""
    from dataclasses import replace

    from quantkit.engines.llmcompressor.model_free import FusedQuantized
    from quantkit.io.shards import TensorSpec

    old = item.modules if isinstance(item, FusedQuantized) else (item.module,)
    names = dict(zip(old, modules))
    outputs = sorted((TensorSpec(names[s.name.rsplit(".", 1)[0]] + "." + s.name.rsplit(".", 1)[1], s.dtype, s.shape)
                      for s in item.outputs), key=lambda s: s.name)
    if isinstance(item, FusedQuantized):
        return replace(item, modules=modules, sources=entries, outputs=outputs)
    return replace(item, module=modules[0], source=entries[0], outputs=outputs)


def write_config(plan: MoePlan, source: Path, out_dir: Path) -> None:
    """config.json: the source's (its `dtype` the run's, under --dtype), with the quantization_config as
    llm-compressor's model-free save writes it."""
    import json

    from llmcompressor.entrypoints.model_free.save_utils import update_config

    config = json.loads((source / "config.json").read_text())
    if plan.dtype is not None:
        config = {**{k: v for k, v in config.items() if k != "torch_dtype"}, "dtype": plan.dtype}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    update_config(out_dir, plan.config)


def write_artifact(plan: MoePlan, info: ModelInfo, out_dir: Path, tokenizer, device="cpu", state: Path | None = None,
                   progress=lambda message: None) -> list[str]:
    """The artifact: the weights (quantkit.engines.llmcompressor.model_free.write_weights: bounded shards, --resume
    by shard), config.json, generation_config.json as stored, recipe.yaml and the tokenizer; returns the shards."""
    import shutil

    from quantkit.engines.llmcompressor.model_free import write_recipe, write_weights

    files = write_weights(plan, out_dir, device, state=state, progress=progress)
    write_config(plan, info.path, out_dir)
    if (info.path / "generation_config.json").is_file():
        shutil.copyfile(info.path / "generation_config.json", out_dir / "generation_config.json")
    write_recipe(plan.modifier, info.path, out_dir)
    tokenizer.save_pretrained(out_dir)
    return files


# ------------------------------------------------------------------ what the methods call


def check(info: ModelInfo, method: str, refused: dict[str, bool]) -> None:
    """Before any work: an MoE checkpoint this path cannot read, or options it cannot apply (`refused`: {what the
    option does: whether it was asked}), exit 2 with the reason."""
    why = blocker(info)
    if why:
        raise UnsupportedError(f"{method} on MoE model '{info.model_type}' takes the model-free path, which cannot "
                               f"read it: {why}", hint="give the 16-bit safetensors checkpoint of a supported family")
    asked = [what for what, on in refused.items() if on]
    if asked:
        raise UnsupportedError(f"{method} on MoE model '{info.model_type}': {asked[0]} needs the loaded model, and "
                               "mixture-of-experts checkpoints are quantized model-free, by checkpoint names",
                               hint="drop that option for this model")


def working_set_bytes(info: ModelInfo, ignore: list[str], whole: bool) -> int:
    """Memory the path holds above the interpreter's (preflight): SLAB_WORKING_SET times the largest piece
    quantized at once: a slab of the largest quantized weight, or with `whole` (an NVFP4 scheme: global scales)
    the largest weight or fused set whole (vLLM's fused layers, quantkit.arch.fused: llm-compressor's
    FUSED_LAYER_NAMES group the same projections). Reads the headers only."""
    from quantkit.arch.fused import FUSED_SHARDS
    from quantkit.engines.llmcompressor.model_free import SLAB_BYTES, SLAB_WORKING_SET
    from quantkit.io.safetensors import DTYPE_BYTES

    def size(module: str) -> int:
        dtype, shape = info.tensors[f"{module}.weight"]
        return shape[0] * shape[1] * DTYPE_BYTES.get(dtype, 2)

    quantized = quantized_modules(info, ignore)
    largest = max((size(m) for m in quantized), default=0)
    if not whole:
        return SLAB_WORKING_SET * min(SLAB_BYTES, largest)
    sets = fused_sets(quantized, list(FUSED_SHARDS.values()))
    return SLAB_WORKING_SET * max([largest, *(sum(size(m) for m in s) for s in sets)])


def preset_scheme(preset: str):
    """compressed-tensors' preset scheme (NVFP4A16, MXFP4A16) over Linear."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def quantize(job, scheme) -> dict:
    """Write the job's artifact through this path; returns the report's details (`path`, the written ignore list's
    length, the MTP layers kept)."""
    from quantkit.engines.transformers import device_map, load_tokenizer, torch_dtype

    asked = torch_dtype(job.dtype, job.info)
    plan = plan_moe(job.info, scheme, job.ignore, None if asked == torch_dtype("auto", job.info) else asked)
    state = None if job.resume_dir is None else job.resume_dir / "shards.json"
    if state is not None:
        state.parent.mkdir(parents=True, exist_ok=True)
    if job.ranks.is_main:  # under torchrun rank 0 writes alone: nothing is calibrated, the ranks have nothing to share
        write_artifact(plan, job.info, job.out_dir, load_tokenizer(job.info, job.trust_remote_code),
                       device_map(job.device), state, job.progress)
    details = {"path": "model-free: mixture-of-experts, by checkpoint names"}
    mtp = mtp_prefixes(job.info)
    return {**details, "mtp_layers_kept": [p.rstrip(".") for p in mtp]} if mtp else details
