"""Quantize a data-free scheme without loading the model: a tensor at a time from the safetensors.

The engine is llm-compressor's model-free PTQ (`llmcompressor.entrypoints.model_free`): its
`ModelFreePtqConverter.process` quantizes and compresses a dict of weight tensors with the same
observers and compressors `oneshot` uses, and compressed-tensors writes the index. The loop around
it is ours because `model_free_ptq` reads one whole input shard at a time (a checkpoint saved as
one 2 GB file is 2 GB in memory) and writes each output shard from memory. Here:

- what is quantized is decided exactly as `oneshot` decides it: the transformers model is built on
  the meta device from config.json, llm-compressor's QuantizationModifier resolves the scheme, and
  compressed-tensors' `apply_quantization_config` matches its targets (`Linear` by module class)
  and the run's ignore list against the module names; the quantization_config written into
  config.json comes from that meta model through compressed-tensors' `ModelCompressor`, as the
  save after `oneshot` writes it;
- checkpoint names map to module names through transformers' own loading conversions (renamings
  only: a checkpoint whose tensors transformers fuses or splits while loading takes the loaded
  path), and every tensor is written under its checkpoint name, which is where transformers'
  save puts it back;
- the output is planned first: the converter runs on meta tensors to give every output tensor's
  dtype and shape, so each shard's header (quantkit.io.shards) is written before any data; then a
  weight is read a slab of rows at a time with plain reads, quantized (per-channel scales make
  rows independent, so slabs give the bytes the whole matrix would), and written at its offset;
  tensors kept as they are stored are copied by the kernel, never read into memory.

Peak memory: one slab of one weight, its quantized copy and the next slab (read from disk while the
current one is quantized), whatever the model's size; on a GPU the slabs are larger (GPU_SLAB_BYTES).
`quantkit.methods.fp8.quantize` decides when this path is exact (`plan_stream` returns a reason
when it is not), and tests/methods/test_model_free.py checks it against `oneshot` tensor by tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import InternalError
from quantkit.io.checkpoint import ModelInfo
from quantkit.io.shards import TensorSpec, safetensors_dtype

SLAB_BYTES = 32 * 1024 * 1024  # stored bytes of the rows of one weight quantized (or cast) at a time
GPU_SLAB_BYTES = 256 * 1024 * 1024  # on a GPU: fewer, larger slabs keep it busy (the next one read meanwhile)
# What quantizing one slab holds, in multiples of its stored bytes: the slab read, its copy in the
# converter's Linear, the quantizer's float32 intermediates and the fp8 result (measured on a 1B
# Llama: ~270 MiB above the streamed baseline's peak with 32 MiB slabs, llm-compressor's imports included).
SLAB_WORKING_SET = 9  # and the next slab, read ahead
# config.json keys of multi-token-prediction layers: their tensors are in the checkpoint but not in
# the transformers model (llm-compressor copies them into its output aside from the model).
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def config_blocker(info: ModelInfo, quantize_lm_head: bool) -> str | None:
    """Why the model-free path cannot apply, read from config.json and the safetensors headers only
    (no torch: `quantkit inspect` and the preflight ask it too); None when it may. Whatever passes
    here is checked again on the meta model by `plan_stream`."""
    from quantkit.arch.moe import expert_count

    text = info.config.get("text_config") or info.config
    if info.is_quantized:
        return "the checkpoint is quantized (a QLoRA base is dequantized by loading it)"
    if expert_count(info.config):
        return ("mixture-of-experts: transformers fuses the experts while loading and llm-compressor saves them "
                "linearized under the checkpoint's names (quantkit.arch.moe)")
    if info.config.get("auto_map"):
        return "the model has custom modeling code"
    if any(text.get(key) or info.config.get(key) for key in MTP_KEYS):
        return "multi-token-prediction layers live outside the transformers model"
    if quantize_lm_head and text.get("tie_word_embeddings", info.config.get("tie_word_embeddings", True)) is not False:
        return "a tied lm_head to quantize (llm-compressor unties it from the embeddings)"
    return None


def working_set_bytes(info: ModelInfo) -> int:
    """Memory the model-free path holds above the interpreter's (preflight): one slab of the largest
    stored tensor, SLAB_WORKING_SET times over; a tensor kept as stored never passes through memory."""
    from quantkit.io.safetensors import DTYPE_BYTES

    largest = max((math.prod(shape) * DTYPE_BYTES.get(dtype, 1) for dtype, shape in info.tensors.values()), default=0)
    return SLAB_WORKING_SET * min(SLAB_BYTES, largest)


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Copied:
    """A tensor kept as it is: copied byte for byte, or cast to the dtype transformers loads it in."""

    name: str
    source: Any  # quantkit.io.safetensors.StoredTensor
    dtype: str  # safetensors dtype written

    @property
    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.name, self.dtype, self.source.shape)]


@dataclass(frozen=True)
class Quantized:
    """A Linear weight quantized through llm-compressor's model-free converter."""

    module: str  # checkpoint name of the module: outputs are `module.weight`, `module.weight_scale`, ...
    source: Any  # quantkit.io.safetensors.StoredTensor of `module.weight`
    dtype: Any  # torch dtype transformers would load the weight in (what oneshot quantizes)
    converter: Any  # llmcompressor ModelFreePtqConverter holding this module's scheme
    outputs: list[TensorSpec]  # what the converter writes for it (planned on the meta device)
    # rows that quantize together (row_unit): 1 where every row has its own scales (per-channel, per-group:
    # fp8-dynamic, mxfp4), the block height for 128x128 blocks (fp8-block); 0: the whole matrix at once
    # (one scale over all of it, or NVFP4's global scale). Slabs of rows are cut at multiples of it.
    row_unit: int

    @property
    def slabs(self) -> bool:
        return self.row_unit > 0


@dataclass(frozen=True)
class FusedQuantized:
    """Linear weights vLLM loads into one fused layer (q/k/v, gate/up of a dense MLP, of an expert, of the shared
    experts; MLA's q_a/kv_a) under an NVFP4 scheme: quantized together, each whole, so that they share one global
    scale (`quantize_fused`)."""

    modules: tuple[str, ...]  # checkpoint module names, in llm-compressor's fused-group order
    sources: tuple  # quantkit.io.safetensors.StoredTensor of each module's weight
    dtype: Any  # torch dtype the weights are quantized in (as stored)
    scheme: Any  # compressed-tensors QuantizationScheme
    outputs: list[TensorSpec]  # every member's tensors (planned on the meta device)


@dataclass
class StreamPlan:
    items: list  # Copied | Quantized, in checkpoint file order
    model: Any  # the meta-device transformers model, its Linear modules carrying their schemes
    compressor: Any  # compressed_tensors ModelCompressor: the quantization_config to write
    modifier: Any  # the llm-compressor QuantizationModifier (recipe.yaml)


def meta_model(info: ModelInfo, dtype, trust_remote_code: bool = False):
    """The model transformers would load from info.path (the Auto class quantkit.engines.transformers.load_model
    uses), parameters on the meta device, tied as from_pretrained ties them."""
    from accelerate import init_empty_weights

    from quantkit.engines.transformers import auto_model_class, hf_config

    with init_empty_weights(include_buffers=False):
        model = auto_model_class(info.config).from_config(hf_config(info.path, trust_remote_code), dtype=dtype,
                                                          trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model.eval()


@dataclass(frozen=True)
class Renaming:
    names: dict[str, str]  # checkpoint tensor name -> the model's state-dict name
    used: list  # the transformers WeightRenamings that renamed some tensor


def module_names(model, checkpoint_names: list[str]) -> Renaming | str:
    """How transformers names each checkpoint tensor in the model, through the conversions it applies
    while loading (get_model_conversion_mapping, as from_pretrained calls it); or the reason the
    checkpoint is not a renaming of the model: a conversion that fuses or splits tensors, or a name
    that transformers' save would not write back under itself (revert_weight_conversion)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    names = {}
    for name in checkpoint_names:
        renamed, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, state)
        if converted is not None:
            return f"transformers converts {name} while loading ({converted})"
        names[name] = renamed
    used = [c for c in renamings if c.was_used()]
    reverse = [c.reverse_transform() for c in reversed(used)]
    for name, renamed in names.items():
        saved, _ = rename_source_key(renamed, reverse, [], reverse=True)
        if saved != name:
            return f"transformers would save {name} as {saved}"
    return Renaming(names, used)


def quantized_modules(model, modifier) -> dict[str, Any]:
    """{module name: module} of what oneshot would quantize: the QuantizationModifier's resolved
    config attached by compressed-tensors (the matching oneshot runs: targets by module class,
    the ignore list by module name). Leaves the schemes on the meta model for the quantization_config."""
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized

    apply_quantization_config(model, modifier.resolved_config)
    return {name: module for name, module in model.named_modules() if is_module_quantized(module)}


def tied_names(model) -> dict[str, list[str]]:
    """state-dict name (parameters and persistent buffers) -> every name sharing its tensor (itself
    included)."""
    from quantkit.engines.transformers import tied_groups

    tied = {name: group for group in tied_groups(model) for name in group}
    return {name: tied.get(name, [name]) for name in model.state_dict()}


def plan_stream(info: ModelInfo, dtype, modifier, trust_remote_code: bool = False) -> StreamPlan | str:
    """The model-free plan for this checkpoint loaded in `dtype` and quantized by `modifier` (an
    llm-compressor QuantizationModifier of a data-free scheme), or the reason it would not equal
    oneshot's output."""
    from quantkit.io.checkpoint import SafetensorsWeights

    model = meta_model(info, dtype, trust_remote_code)
    if model._get_dtype_plan(dtype):  # transformers keeps some modules in float32 at this dtype
        return "transformers loads some modules in float32 (_keep_in_fp32_modules)"
    stored = SafetensorsWeights(info.path).index
    renaming = module_names(model, list(stored))
    if isinstance(renaming, str):
        return renaming
    # what from_pretrained leaves on the model: compressed-tensors maps the ignore list it writes back
    # to checkpoint names through it (QuantizationConfig.from_pretrained)
    model._weight_conversions = renaming.used
    names = renaming.names
    reason = check_coverage(model, stored, names)
    if reason:
        return reason
    modules = quantized_modules(model, modifier)
    by_module = {f"{name}.weight": name for name in modules}
    groups = tied_names(model)
    params = dict(model.state_dict())
    items = []
    for name, entry in sorted(stored.items(), key=lambda kv: (str(kv[1].file), kv[1].offset)):  # read in file order
        module = by_module.get(names[name])
        if module is None:
            items.append(Copied(name, entry, safetensors_dtype(params[names[name]].dtype)))
            continue
        if len(groups[names[name]]) > 1:
            return f"{module} is quantized but its weight is tied to {groups[names[name]]}"
        if module.endswith("norm"):
            return f"{module} is a Linear named like a norm, which llm-compressor's model-free matching skips"
        items.append(quantized_item(name.removesuffix(".weight"), entry, params[names[name]].dtype,
                                    modules[module].quantization_scheme))
    return StreamPlan(items, model, compressor_for(model), modifier)


def check_coverage(model, stored: dict, names: dict[str, str]) -> str | None:
    """Every checkpoint tensor is one tensor of the model, of its shape, and every tensor of the
    model (but a tied copy) is in the checkpoint once, as from_pretrained would load it strictly."""
    state = model.state_dict()
    groups = tied_names(model)
    unexpected = sorted(n for n, m in names.items() if m not in state)
    if unexpected:
        return f"checkpoint tensors the model does not have: {unexpected[:3]}"
    shapes = sorted(n for n, m in names.items() if tuple(state[m].shape) != tuple(stored[n].shape))
    if shapes:
        return f"checkpoint tensors whose shape config.json does not give: {shapes[:3]}"
    loaded = set(names.values())
    count = {tuple(group): sum(1 for n in group if n in loaded) for group in groups.values()}
    missing = sorted(group[0] for group, n in count.items() if n == 0)
    if missing:
        return f"tensors missing from the checkpoint: {missing[:3]}"
    twice = sorted(group[0] for group, n in count.items() if n > 1)
    if twice:
        return f"tied tensors stored more than once: {twice[:3]}"
    return None


def quantized_item(module: str, entry, dtype, scheme) -> Quantized:
    """The converter for one module's scheme, and what it writes for the weight (run on the meta device)."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter

    converter = ModelFreePtqConverter(QuantizationConfig(config_groups={"group_0": scheme.model_copy(deep=True)},
                                                         ignore=[]))
    planned = converter.validate({f"{module}.weight": torch.empty(entry.shape, dtype=dtype, device="meta")})
    outputs = [TensorSpec(name, safetensors_dtype(t.dtype), tuple(t.shape)) for name, t in sorted(planned.items())]
    return Quantized(module, entry, dtype, converter, outputs, row_unit_of(scheme, entry.shape[0], outputs))


# rows that quantize together for each weight strategy (compressed-tensors QuantizationStrategy values): per-channel
# and per-group scales belong to one row; a block's to its block of rows; others (tensor, tensor_group) cover all rows
ROW_UNITS = {"channel": lambda args: 1, "group": lambda args: 1, "block": lambda args: int(args.block_structure[0])}


def row_unit_of(scheme, rows: int, outputs: list[TensorSpec]) -> int:
    """Quantized.row_unit of a weight of `rows` rows under `scheme` whose converter writes `outputs`: 0 unless
    every output has one row per `unit` rows of the weight (the rows quantize independently in such units)."""
    strategy = getattr(scheme.weights.strategy, "value", scheme.weights.strategy)
    unit = ROW_UNITS.get(strategy, lambda args: 0)(scheme.weights)
    if unit <= 0:
        return 0
    fits = all(s.shape and s.shape[0] in (rows, math.ceil(rows / unit)) for s in outputs)
    return unit if fits else 0


def output_unit(spec: TensorSpec, rows: int, unit: int) -> int:
    """Weight rows per row of one output: 1 for the weight and per-row scales, `unit` for block scales."""
    return 1 if spec.shape[0] == rows else unit


def quantize_fused(weights: dict, scheme) -> dict:
    """{module.weight: tensor} of one fused set (quantkit.arch.fused: what vLLM loads into one layer) quantized
    and compressed under a microscale scheme with one shared global scale: the steps of llm-compressor's own
    model-free converter for a fused set (ModelFreePtqConverter._process_microscale: a quantized Linear per
    weight, their weight observers fused by llm-compressor's FusionHandler, observed, qparams updated, frozen and
    compressed by compressed-tensors), for the sets its name patterns do not see (an expert's gate/up, the shared
    experts', MLA's q_a/kv_a). Returns every member's compressed tensors under its module name."""
    from compressed_tensors.compressors import compress_module
    from llmcompressor.entrypoints.model_free.lifecycle import (
        initialize_quantized_linear,
        validate_weight_for_quantization,
    )
    from llmcompressor.modifiers.quantization.calibration import (
        apply_calibration_status,
        freeze_module_quantization,
        initialize_observer,
        observe,
        update_qparams,
    )
    from llmcompressor.observers import FusionHandler

    modules = {}
    for name, weight in weights.items():
        validate_weight_for_quantization(weight, scheme, name)
        module = initialize_quantized_linear(weight, scheme, weight.device)
        initialize_observer(module, "weight")
        apply_calibration_status(module)
        modules[name] = module
    FusionHandler.fuse([(module.weight_observer, module) for module in modules.values()])
    observe(modules.values(), base_name="weight")
    update_qparams(modules.values(), base_name="weight")
    out = {}
    for name, module in modules.items():
        freeze_module_quantization(module)
        compress_module(module)
        out.update(module.state_dict(prefix=name.removesuffix("weight")))
    return out


def fused_item(modules: tuple[str, ...], entries: tuple, dtype, scheme) -> FusedQuantized:
    """A fused set and what quantize_fused writes for it (run on the meta device)."""
    import torch

    planned = quantize_fused({f"{m}.weight": torch.empty(e.shape, dtype=dtype, device="meta")
                              for m, e in zip(modules, entries)}, scheme)
    outputs = [TensorSpec(name, safetensors_dtype(t.dtype), tuple(t.shape)) for name, t in sorted(planned.items())]
    return FusedQuantized(modules, entries, dtype, scheme, outputs)


def compressor_for(model):
    """compressed-tensors' ModelCompressor for the meta model's schemes, its status the one the
    compressed save writes (ModelCompressor.compress_model sets it there)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    return compressor


# ------------------------------------------------------------------ writing


def slab_rows(entry, budget: int = SLAB_BYTES) -> int:
    """Rows of a stored tensor read at a time: about `budget` stored bytes."""
    rows = max(1, entry.shape[0])
    return max(1, min(rows, budget // max(1, entry.nbytes // rows)))


def row_slabs(rows: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def read_rows(entry, start: int, stop: int):
    import numpy as np

    from quantkit.io.safetensors import read_stored_rows

    return read_stored_rows(entry, np.arange(start, stop))


def write_copied(writer, item: Copied, budget: int = SLAB_BYTES) -> None:
    """A kept tensor: the kernel copies it when the dtype is the stored one; else it is cast a slab
    of rows at a time, as from_pretrained casts it."""
    import torch

    from quantkit.io.safetensors import TORCH_DTYPES, read_stored, tensor_bytes

    if item.dtype == item.source.dtype:
        writer.copy(item.name, item.source.file, item.source.offset)
        return
    dtype = getattr(torch, TORCH_DTYPES[item.dtype])
    if not item.source.shape:  # a scalar
        writer.write(item.name, tensor_bytes(read_stored(item.source).to(dtype).contiguous()))
        return
    row_bytes = item.outputs[0].nbytes // max(1, item.source.shape[0])
    for start, stop in row_slabs(item.source.shape[0], slab_rows(item.source, budget)):
        writer.write(item.name, tensor_bytes(read_rows(item.source, start, stop).to(dtype).contiguous()),
                     start * row_bytes)


def quantized_slabs(item: Quantized, budget: int) -> list[tuple[int, int]]:
    """The row ranges one Linear weight is quantized in: slabs of about `budget` stored bytes, cut at multiples of
    the rows that quantize together, when its rows quantize independently; else the whole matrix."""
    rows = item.source.shape[0]
    if not item.slabs:
        return row_slabs(rows, rows)
    unit = item.row_unit
    return row_slabs(rows, max(unit, slab_rows(item.source, budget) // unit * unit))


def write_quantized_slab(writer, item: Quantized, start: int, stop: int, rows, device) -> None:
    """Rows start..stop of one Linear weight (as read) through the converter on `device`, written at their offsets."""
    import torch

    from quantkit.io.safetensors import tensor_bytes

    # + 0.0 turns an exact -0 into +0, as oneshot's quantize does by adding the zero point (the
    # converter keeps the sign: fp8 0x80 where oneshot writes 0x00); every other value is unchanged
    weight = rows.to(device=device, dtype=item.dtype, non_blocking=True) + 0.0
    with torch.no_grad():
        out = item.converter.process({f"{item.module}.weight": weight})
    del weight
    specs = {s.name: s for s in item.outputs}
    if sorted(out) != sorted(specs):
        raise InternalError(f"{item.module}: the converter wrote {sorted(out)}, planned {sorted(specs)}")
    rows = item.source.shape[0]
    for name, tensor in out.items():
        spec = specs[name]
        unit = output_unit(spec, rows, item.row_unit) if item.slabs else rows
        expect = (math.ceil((stop - start) / unit), *spec.shape[1:]) if item.slabs else spec.shape
        if tuple(tensor.shape) != expect or safetensors_dtype(tensor.dtype) != spec.dtype:
            raise InternalError(f"{name}: the converter wrote {tensor.dtype} {list(tensor.shape)}, planned "
                                f"{spec.dtype} {list(expect)}")
        row_bytes = spec.nbytes // spec.shape[0] if item.slabs else 0
        writer.write(name, tensor_bytes(tensor.cpu().contiguous()), start // unit * row_bytes)


def read_fused(item: FusedQuantized) -> dict:
    """Every member weight of a fused set, whole, as stored."""
    from quantkit.io.safetensors import read_stored

    return {f"{m}.weight": read_stored(e) for m, e in zip(item.modules, item.sources)}


def write_fused(writer, item: FusedQuantized, weights: dict, device) -> None:
    """A fused set quantized together (quantize_fused) on `device` and written."""
    import torch

    from quantkit.io.safetensors import tensor_bytes

    with torch.no_grad():  # + 0.0: -0 written as +0, as for a single weight (write_quantized_slab)
        out = quantize_fused({n: w.to(device=device, dtype=item.dtype) + 0.0 for n, w in weights.items()},
                             item.scheme)
    specs = {s.name: s for s in item.outputs}
    if sorted(out) != sorted(specs):
        raise InternalError(f"{item.modules}: quantized into {sorted(out)}, planned {sorted(specs)}")
    for name, tensor in out.items():
        spec = specs[name]
        if tuple(tensor.shape) != spec.shape or safetensors_dtype(tensor.dtype) != spec.dtype:
            raise InternalError(f"{name}: quantized into {tensor.dtype} {list(tensor.shape)}, planned "
                                f"{spec.dtype} {list(spec.shape)}")
        writer.write(name, tensor_bytes(tensor.cpu().contiguous()))


def slab_budget(device) -> int:
    """Stored bytes of rows quantized at a time: SLAB_BYTES on a CPU, GPU_SLAB_BYTES on a GPU."""
    import torch

    return GPU_SLAB_BYTES if torch.device(device).type == "cuda" else SLAB_BYTES


def write_shard(writer, items: list, device, budget: int) -> None:
    """One shard's tensors: kept ones copied (or cast), then every slab of every quantized weight, the next
    slab read from disk while the current one is quantized and written (quantkit.io.readahead)."""
    from quantkit.io.memory import release_freed_memory
    from quantkit.io.readahead import read_ahead

    for item in items:
        if isinstance(item, Copied):
            write_copied(writer, item, budget)
    slabs = []  # (item, first row, last row + 1); a fused set is read and quantized whole
    for item in items:
        if isinstance(item, FusedQuantized):
            slabs.append((item, 0, 0))
        elif isinstance(item, Quantized):
            slabs += [(item, start, stop) for start, stop in quantized_slabs(item, budget)]
    reads = (lambda s=slab: read_fused(s[0]) if isinstance(s[0], FusedQuantized) else read_rows(s[0].source, s[1], s[2])
             for slab in slabs)
    for (item, start, stop), rows in zip(slabs, read_ahead(reads)):
        if isinstance(item, FusedQuantized):
            write_fused(writer, item, rows, device)
        else:
            write_quantized_slab(writer, item, start, stop, rows, device)
        del rows
        release_freed_memory()


def write_weights(plan: StreamPlan, out_dir: Path, device="cpu", shard_bytes: int | None = None,
                  slab_bytes: int | None = None, state: Path | None = None,
                  progress: Callable[[str], None] = lambda message: None) -> list[str]:
    """Every tensor of the plan into bounded safetensors shards in out_dir (plus the index when there
    are several); returns the shard file names. A module's outputs stay in one shard. `state`: the file
    recording each finished shard's sha256 (--resume); the shards an interrupted run of the same layout
    finished, and that still verify, are kept and the rest written."""
    from quantkit.io.shards import SHARD_BYTES, ShardWriter, layout_shards, write_index

    layouts = layout_shards([item.outputs for item in plan.items], shard_bytes or SHARD_BYTES)
    shard_of = {name: index for index, layout in enumerate(layouts) for name in layout.specs}
    saved = ShardProgress(layout_digest(layouts), finished_shards(out_dir, layouts, state, progress))
    for index in range(len(saved.shards), len(layouts)):
        layout = layouts[index]
        with ShardWriter(layout, out_dir / layout.file) as writer:
            items = [i for i in plan.items if shard_of[i.outputs[0].name] == index]
            write_shard(writer, items, device, slab_bytes or slab_budget(device))
        record_shard(state, saved, out_dir / layout.file)
    write_index(out_dir, layouts)
    return [layout.file for layout in layouts]


@dataclass
class ShardProgress:
    """What a --resume run saved: the shard layout's digest and each finished shard's sha256, in order."""

    layout_sha256: str
    shards: list[str]


def layout_digest(layouts: list) -> str:
    """sha256 of every shard's name and header (the tensors, their dtypes, shapes and offsets)."""
    digest = hashlib.sha256()
    for layout in layouts:
        digest.update(layout.file.encode() + b"\0" + layout.header)
    return digest.hexdigest()


def file_sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None


def load_progress(state: Path | None) -> ShardProgress | None:
    try:
        data = json.loads(Path(state).read_text()) if state is not None else None
        return ShardProgress(str(data["layout_sha256"]), [str(h) for h in data["shards"]]) if data else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished_shards(out_dir: Path, layouts: list, state: Path | None, progress: Callable[[str], None]) -> list[str]:
    """The sha256s of the leading shards an interrupted run finished that verify (size and sha256) under
    the same layout; [] without saved progress or with another layout (said through `progress`)."""
    saved = load_progress(state)
    if saved is None or not saved.shards:
        return []
    if saved.layout_sha256 != layout_digest(layouts):
        progress("model-free: the saved progress was written for another shard layout; writing every shard")
        return []
    good = []
    for layout, sha in zip(layouts, saved.shards):
        path = out_dir / layout.file
        if not path.is_file() or path.stat().st_size != layout.size or file_sha256(path) != sha:
            break
        good.append(sha)
    progress(f"model-free: resuming after {len(good)} of {len(layouts)} shards (verified by sha256)")
    return good


def record_shard(state: Path | None, saved: ShardProgress, path: Path) -> None:
    """A shard is finished: its sha256 added to the saved progress (written whole, fsynced, renamed over it)."""
    if state is None:
        return
    from quantkit.io.export import replace_json

    saved.shards.append(file_sha256(path) or "")
    replace_json(state, asdict(saved))


def write_config(plan: StreamPlan, out_dir: Path) -> None:
    """config.json as the compressed save after oneshot writes it: transformers' serialization of the
    config, replaced by llm-compressor with the original config.json patched where the model
    differs (dtype, tie_word_embeddings), then compressed-tensors' quantization_config."""
    from llmcompressor.transformers.compression.compressed_tensors_utils import resave_config

    plan.model.config.save_pretrained(out_dir)
    resave_config(plan.model.config, str(out_dir))
    plan.compressor.update_config(str(out_dir))


def write_generation_config(plan: StreamPlan, source: Path, out_dir: Path) -> None:
    """generation_config.json as save_pretrained writes it: the checkpoint's (from_pretrained loads
    it), else the one transformers derives from config.json; none for a model that cannot generate."""
    from transformers import GenerationConfig

    if not plan.model.can_generate():
        return
    from_file = (source / "generation_config.json").is_file()
    (GenerationConfig.from_pretrained(source) if from_file else plan.model.generation_config).save_pretrained(out_dir)


def write_recipe(modifier, source: Path, out_dir: Path) -> None:
    """recipe.yaml: the llm-compressor recipe of this quantization, appended to the source's own, as
    the save after oneshot writes it."""
    from llmcompressor.recipe import Recipe
    from llmcompressor.transformers.utils.helpers import RECIPE_FILE_NAME, infer_recipe_from_model_path

    recipe = Recipe.from_modifiers(modifier)
    recipe.yaml(file_path=str(out_dir / RECIPE_FILE_NAME), existing_recipe_path=infer_recipe_from_model_path(source))
