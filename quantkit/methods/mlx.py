"""MLX affine quantization for Apple silicon: an mlx-lm model directory with calibrated scales and biases.

Output: what `mlx_lm.convert -q` writes (quantkit.mlx.checkpoint): `model.safetensors` with each
quantized module's packed uint32 `weight`, `scales` and `biases` (quantkit.mlx.affine), config.json
with the `quantization` block (a per-module entry where `layer_bits` or the ignore list differ from
`bits`), the tokenizer files; `mlx_lm.generate --model OUT` runs it.

The same modules as mlx_lm.convert are quantized (every Linear of the decoder, the token embedding and
the output head, where the group size divides the input width; `--ignore` keeps a module 16-bit), in
the same format and size; what differs is how each group's scale and bias are chosen. mlx_lm.convert
rounds each group's min..max range to the nearest levels. quantkit first runs the calibration windows
through the model (streamed a layer at a time) and records, for every Linear, the mean squared
activation of each input column; each group's (scale, bias) is then the one minimizing the error
weighted by those column importances (a grid of ranges fitted by weighted least squares, as llama.cpp
does for k-quants; quantkit.mlx.affine.quantize). The output head is weighted by the final hidden
states (and, when tied, so is the embedding); an untied embedding by plain squared error.
`calibrate: false` gives plain min/max rounding with no calibration windows.

Mixtures of experts (the families whose record has `mlx_experts`): each routed projection is written stacked, as
mlx-lm's SwitchGLU holds it (`<block>.switch_mlp.<projection>`, [experts, out, in]), every expert quantized on its
own along its last axis, with its own column importances: the inputs of the tokens the router sends it (the hidden
states for gate and up, act(gate) * up for down), recorded on llm-compressor's linear experts (one Linear per
expert projection, run on its routed tokens only) in the calibration forward; the same values the GGUF imatrix
collects from transformers' fused experts. An expert no calibration token reaches is weighted by plain squared
error. The routers stay 16-bit (config.json's entry false), as quantkit keeps them for every method;
mlx_lm.convert quantizes them. Their correction bias keeps its stored dtype, as mlx_lm.convert keeps it.
`layer_bits` names a stacked projection by its `switch_mlp` name. Experts stored fused across experts (GPT-OSS, Llama
4, Granite 4's MoE variant) are cut into the SwitchGLU's projections (`mlp.experts.gate_proj` ...), their importances
recorded by a forward hook on transformers' experts module (FusedImportance: the family's `mlx_experts.inputs`);
those a Qwen mixture stores in transformers' fused layout are read as the per-expert tensors they hold
(quantkit.mlx.checkpoint.PerExpertWeights), so the artifact is the per-expert checkpoint's. The multi-token-prediction
layers after the decoder's are not written (mlx-lm's models have none).

An affine group (w = scale * q + bias) is an asymmetric integer group with a zero point; the gate
reads the file back with quantkit's own dequantization, bit-exact with mlx.core.dequantize.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantkit.errors import UnsupportedError
from quantkit.formats import mlx as mlx_format
from quantkit.methods import AutoRung, Layers, MethodSpec, OnRanks, QuantizeJob, QuantizeResult, Sizes
from quantkit.mlx.affine import BITS
from quantkit.mlx.checkpoint import MLX_MODEL_TYPES, QUANTIZED_ROLES, Precision

Bits = Literal[2, 3, 4, 6, 8]
# By bits: 8 and 6 near-lossless, each step down looser (the gguf gates for the same bits per weight).
GATE_BY_BITS = {
    8: {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95},
    6: {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95},
    4: {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80},
    3: {"max_ppl_increase": 0.20, "max_kld": 0.20, "min_top1": 0.70},
    2: {"max_ppl_increase": 0.40, "max_kld": 0.40, "min_top1": 0.60},
}
KEEP = "16-bit"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: Bits = 4
    group_size: Literal[32, 64, 128] = Field(64, description="input columns sharing one scale and bias (mlx-lm's "
                                              "default: 64)")
    calibrate: bool = Field(True, description="scales and biases fitted to the calibration activations; false: "
                            "plain min/max rounding, as mlx_lm.convert")
    layer_bits: dict[str, int | Literal["16-bit"]] = Field(
        default_factory=dict, description="per-module bits by name or re:REGEX (first match wins), e.g. "
        "{'re:.*down_proj': 6, lm_head: 8}; '16-bit' keeps a module unquantized")

    @field_validator("layer_bits")
    @classmethod
    def _known_bits(cls, value: dict) -> dict:
        for pattern, bits in value.items():
            if bits != KEEP and bits not in BITS:
                raise ValueError(f"layer_bits[{pattern!r}] = {bits}: use one of {', '.join(map(str, BITS))} or 16-bit")
            if pattern.startswith("re:"):
                re.compile(pattern[3:])
        return value


def default_gate(options: Options) -> dict:
    return dict(GATE_BY_BITS[options.bits])


def needs_calibration(options: Options) -> bool:
    return options.calibrate


def module_precision(options: Options, name: str, shape: list[int], ignore: list[str] = ()) -> Precision | None:
    """A quantizable module's precision: its layer_bits entry, else `bits`; None (16-bit) when ignored,
    set to 16-bit, or the group size does not divide its input width (mlx_lm.convert skips those too)."""
    from quantkit.arch.roles import matches

    if matches(name, list(ignore)) or shape[-1] % options.group_size:
        return None
    bits = next((b for pattern, b in options.layer_bits.items() if matches(name, [pattern])), options.bits)
    return None if bits == KEEP else Precision(int(bits), options.group_size)


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    from quantkit.arch.moe import is_expert_weight

    if role not in QUANTIZED_ROLES or len(shape) != 2 or is_expert_weight(name):  # experts: exact_types
        return None
    chosen = module_precision(options, name, shape)
    return None if chosen is None else precision_text(chosen, options)


def precision_text(chosen: Precision, options: Options) -> str:
    how = "calibrated" if options.calibrate else "min/max rounding"
    return f"mlx affine {chosen.bits}-bit g{chosen.group_size} ({how})"


def layer_plan(info, options: Options, ignore: list[str]) -> dict[str, Precision | None]:
    """{module name: precision or None} of every module mlx-lm could quantize (Linear and Embedding weights); of a
    mixture of experts, the routers None (16-bit, their config.json entry false) and each routed projection as the
    SwitchGLU module mlx-lm stacks it into (quantkit.mlx.checkpoint.expert_stacks), one precision for all its
    experts: `layer_bits` takes it by that name, the ignore list by its experts' names (all of them: check_ignore);
    the multi-token-prediction layers left out (not written: quantkit.mlx.checkpoint.mtp_layers, and those the
    family's mlx layout drops); experts stored fused (GPT-OSS) as the SwitchGLU projections they are cut into
    (quantkit.mlx.checkpoint.fused_modules), the ignore list taking them by either name."""
    from quantkit.arch.roles import classify, linear_weights, matches
    from quantkit.mlx.checkpoint import expert_stacks, fused_modules, mtp_layers, per_expert_info, written_name

    info = per_expert_info(info)
    mtp = mtp_layers(info.config, info.tensors)
    linear = {name: shape for name, shape in linear_weights(info).items()
              if not name.startswith(mtp) and written_name(info.config, name) is not None}
    stacks = expert_stacks(info.config, [name + ".weight" for name in linear])
    stacked = {n.removesuffix(".weight") for names in stacks.values() for n in names}
    plan = {}
    for name, shape in linear.items():
        role = classify(name + ".weight", info.towers)
        if role == "router":
            plan[name] = None
        elif role in QUANTIZED_ROLES and name not in stacked:
            plan[name] = module_precision(options, name, shape, ignore)
    for module, names in stacks.items():
        experts = [n.removesuffix(".weight") for n in names]
        kept = all(matches(expert, list(ignore)) for expert in experts)
        plan[module] = None if kept else module_precision(options, module, [len(names), *linear[experts[0]]])
    for module, (tensor, shape) in fused_modules(info.config, info.tensors).items():
        plan[module] = None if matches(tensor, list(ignore)) else module_precision(options, module, shape, ignore)
    return plan


def exact_types(info, options: Options) -> dict[str, str]:
    """The plan's entries of the routed experts: each expert the precision of the stacked module it is written in
    (experts stored fused: the SwitchGLU projection cut from the fused tensor, quantkit.arch.moe.fused_expert_linears)."""
    from quantkit.arch.moe import fused_expert_linears
    from quantkit.mlx.checkpoint import expert_stacks, fused_piece_name, fused_tensor, per_expert_info

    info = per_expert_info(info)
    plan = layer_plan(info, options, [])
    stacks = expert_stacks(info.config, info.tensors)
    written = {name.removesuffix(".weight"): module for module, names in stacks.items() for name in names}
    for name, (tensor, _shape) in fused_expert_linears(info.config, info.tensors).items():
        block, _fused, _bias = fused_tensor(info.config, tensor)
        written[name] = fused_piece_name(info.config, block, name.rsplit(".", 1)[1], False).removesuffix(".weight")
    return {name: precision_text(plan[module], options) for name, module in written.items()
            if plan.get(module) is not None}


def check_ignore(info, options: Options, ignore: list[str]) -> None:
    """A stacked expert projection is one tensor in mlx-lm: an ignore list that takes some of its experts and not the
    others is refused before work (UnsupportedError)."""
    from quantkit.arch.roles import matches
    from quantkit.mlx.checkpoint import expert_stacks, per_expert_info

    info = per_expert_info(info)
    for module, names in expert_stacks(info.config, info.tensors).items():
        taken = [matches(name.removesuffix(".weight"), list(ignore)) for name in names]
        if any(taken) and not all(taken):
            raise UnsupportedError(f"mlx: the ignore list keeps {sum(taken)} of the {len(names)} experts of {module} "
                                   "16-bit: mlx-lm stores a projection's experts as one tensor, of one precision",
                                   hint="ignore every expert of it (e.g. re:.*experts\\.\\d+\\.up_proj$) or none")


def family_refusal(model_type: str, is_vlm: bool) -> str | None:
    from quantkit.arch import moe
    from quantkit.arch.families import by_model_type

    family = by_model_type(model_type)
    if is_vlm:
        return "a VLM's towers are not in mlx-lm (mlx-vlm runs those)"
    if family is not None and family.mlx_refusal:
        return family.mlx_refusal
    if moe.is_moe(model_type) and (family is None or family.mlx_experts is None):
        return "no mlx-lm model that loads its experts stacked is written for it"
    if model_type not in MLX_MODEL_TYPES:
        return "not among the mlx-lm models written with the Hugging Face tensor names"
    return None


def check(info, options: Options, calibration=None) -> None:
    from quantkit.arch import moe
    from quantkit.arch.families import of_config
    from quantkit.arch.vlm import is_vlm
    from quantkit.mlx.checkpoint import per_expert_info

    refusal = family_refusal(info.model_type, is_vlm(info.config))
    if refusal:
        raise UnsupportedError(f"mlx: model_type '{info.model_type}': {refusal}",
                               hint="mlx writes " + ", ".join(sorted(MLX_MODEL_TYPES)) + " models; "
                               "use --method gguf for llama.cpp on Apple silicon")
    family = of_config(info.config)
    for family_check in family.mlx_checks if family is not None else ():  # the family's own reason first
        family_check(info.config)
    if family is None or family.mlx_experts is None or not family.mlx_experts.fused:  # fused: read as stored
        info = per_expert_info(info)
        check_per_expert(info)
        moe.check_supported(info, "mlx")  # a family's mixture-of-experts variant without an expert layout


def check_per_expert(info) -> None:
    """A family whose experts are written stacked from one tensor per expert: experts stored fused across experts
    in a layout it does not cut (per_expert_info cuts the Qwen mixtures' transformers layout) are refused before
    work."""
    from quantkit.mlx.checkpoint import FUSED_TENSOR

    fused = sorted(name for name in info.tensors if (m := FUSED_TENSOR.match(name)) and not m["tensor"].isdigit())
    if fused:
        raise UnsupportedError(f"mlx: {info.model_type}'s experts are stored fused across experts ('{fused[0]}'): "
                               "the mlx method writes this family's experts from one tensor per expert only",
                               hint="use --method gguf (which converts them as llama.cpp's converter does), or save "
                                    "the checkpoint with one tensor per expert (experts.N.gate_proj ...)")


def support(family) -> str:
    from quantkit.arch import moe
    from quantkit.arch.families import by_model_type

    refusal = family_refusal(family.model_type, family.is_vlm)
    if refusal:
        return f"refused: {refusal}"
    record = by_model_type(family.model_type)
    experts = moe.is_moe(family.model_type) or (record is not None and record.mlx_experts is not None)
    return "✅ experts stacked per projection, routers 16-bit" if experts else "✅"


# ---------------------------------------------------------------- calibration: column importances


def column_importance(job: QuantizeJob) -> dict:
    """{module name: mean squared input activation per column} of every Linear on the calibration
    windows, the base in float32 (CPU kernels are fastest there, and the statistics want it), whole where
    the run's placement has room for it, else streamed a layer at a time (quantkit.eval.resident.forward_model);
    the output head's from the final hidden states; each stacked expert projection's per expert ([experts,
    columns]: calibration_base)."""
    import torch

    from quantkit.engines.transformers import device_map, hf_config
    from quantkit.eval.evaluate import iter_batches
    from quantkit.eval.resident import forward_model
    from quantkit.eval.stream import last_hidden, windows_per_group

    config = hf_config(job.info.path)
    model, source, stored = calibration_base(job.info, config)
    streamed = forward_model(config, source, torch.float32, device_map(job.device), job.placement.room, model)
    sums: dict[str, list] = {}

    def record(name: str, x) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        entry = sums.setdefault(stored.get(name, name), [0.0, 0])
        entry[0], entry[1] = entry[0] + (x * x).sum(0).cpu(), entry[1] + x.shape[0]

    hooks = [module.register_forward_hook(lambda m, inputs, out, name=name: record(name, inputs[0]))
             for name, module in streamed.model.named_modules() if isinstance(module, torch.nn.Linear)
             and module is not streamed.head]
    fused = FusedImportance(job.info.config, job.info.tensors)
    hooks += fused.hooks(streamed.model)
    head = next(n for n, m in streamed.model.named_modules() if m is streamed.head)
    group = windows_per_group(config.get_text_config(), job.windows.calib.shape[1])
    try:
        with torch.no_grad():
            for ids in iter_batches(job.windows.calib, group):
                record(head, last_hidden(streamed, ids))
    finally:
        for hook in hooks:
            hook.remove()
    imp = {name: (total / max(count, 1)).to(torch.float32) for name, (total, count) in sums.items()}
    return imp | stacked_importance(job.info, imp) | fused.importances()


class FusedImportance:
    """Each expert's column importances of experts stored fused (GPT-OSS), from forward hooks on transformers'
    experts modules (`<block>experts`, the checkpoint's fused tensors' module): the family's `mlx_experts.inputs`
    (routed_rows where it has none) gives each SwitchGLU projection's per-expert input rows; `importances()` is
    {SwitchGLU module: [experts, columns]} (zeros for an expert no calibration token reached:
    quantkit.mlx.affine.importance_floor)."""

    def __init__(self, config: dict, tensors):
        from quantkit.arch.families import of_config
        from quantkit.arch.moe import load_renamings
        from quantkit.eval.experts import model_name, text_model_type
        from quantkit.mlx.checkpoint import fused_tensor

        self.family, self.sums = of_config(config), {}
        renamings = load_renamings(text_model_type(config))
        # {transformers' experts module: its block}: the modules holding the checkpoint's fused tensors (under the
        # name transformers loads them by: Granite's input_linear.weight is experts.gate_up_proj)
        self.owners = {model_name(name, None, renamings).rsplit(".", 1)[0]: found[0] for name in tensors
                       if (found := fused_tensor(config, name)) is not None}

    def hooks(self, model) -> list:
        if not self.owners:
            return []
        inputs = self.family.mlx_experts.inputs or routed_rows
        return [module.register_forward_hook(lambda m, args, out, block=self.owners[name]:
                                             self.record(block, inputs(m, args)))
                for name, module in model.named_modules() if name in self.owners]

    def record(self, block: str, rows: dict[str, list]) -> None:
        import torch

        for projection, per_expert in rows.items():
            module = f"{block}{self.family.mlx_experts.module}.{projection}"
            squares = torch.stack([(x.to(torch.float64) ** 2).sum(0).cpu() for x in per_expert])
            counts = torch.tensor([x.shape[0] for x in per_expert], dtype=torch.float64)
            total, count = self.sums.get(module, (0.0, 0.0))
            self.sums[module] = (total + squares, count + counts)

    def importances(self) -> dict:
        import torch

        return {module: (total / count.clamp(min=1)[:, None]).to(torch.float32)
                for module, (total, count) in self.sums.items()}


def routed_rows(module, inputs: tuple) -> dict[str, list]:
    """Each expert's input rows in a transformers experts module that takes the router's choice (GPT-OSS's, Granite 4
    MoE's), as llama-imatrix collects them (quantkit.gguf.imatrix.expert_inputs): the routed hidden states for gate
    and up, the gated activation (the module's own gate: GPT-OSS's clamped SwiGLU) for down."""
    from quantkit.gguf.imatrix import expert_inputs

    rows = expert_inputs(module, inputs)
    return {"gate_proj": rows["gate_up"], "up_proj": rows["gate_up"], "down_proj": rows["down"]}


def calibration_base(info, config):
    """(meta-device model, its weights, {its module name: the checkpoint's}) the calibration windows run through:
    the CausalLM of `config`; for a mixture of experts, with llm-compressor's linear experts (one Linear per expert
    projection, run on the tokens the router sends that expert only: quantkit.eval.experts.linear_experts_model),
    the checkpoint's tensors renamed as that model names them; otherwise renamed as transformers' loading renames
    them (Granite 4 MoE's fused experts)."""
    import torch

    from quantkit.eval import experts
    from quantkit.mlx.checkpoint import per_expert_source

    source, model_type = per_expert_source(info), experts.text_model_type(info.config)
    layout = experts.mlx_expert_layout(info.config)
    renamed = experts.RenamedWeights(source, layout, model_type) if layout is not None else \
        experts.load_named(source, model_type)
    stored = {name.removesuffix(".weight"): checkpoint.removesuffix(".weight")
              for name, checkpoint in getattr(renamed, "names", {}).items()}
    return (None if layout is None else experts.linear_experts_model(config, torch.float32)), renamed, stored


def stacked_importance(info, imp: dict) -> dict:
    """{SwitchGLU module: its experts' column importances stacked ([experts, columns])}: an expert no calibration
    token reached has zeros (quantkit.mlx.affine.importance_floor: plain squared error)."""
    import torch

    from quantkit.arch.roles import linear_weights
    from quantkit.mlx.checkpoint import expert_stacks

    linear = linear_weights(info)
    out = {}
    for module, names in expert_stacks(info.config, info.tensors).items():
        experts = [name.removesuffix(".weight") for name in names]
        columns = linear[experts[0]][-1]
        out[module] = torch.stack([imp.get(e, torch.zeros(columns)) for e in experts])
    return out


def importance_of(name: str, imp: dict, info):
    """The column importances a module's groups are weighted by: its own; a tied embedding's, the head's."""
    if name in imp:
        return imp[name]
    if name.endswith("embed_tokens") and info.config.get("tie_word_embeddings"):
        return next((v for k, v in imp.items() if k.endswith("lm_head")), None)
    return None


def is_embedding(module: str, info) -> bool:
    """An embedding (the token one, Gemma 4's per-layer one): no column importances (plain squared error)."""
    from quantkit.arch.roles import classify

    return classify(module + ".weight", info.towers) == "embeddings"


# ---------------------------------------------------------------- quantize


def quantize(job: QuantizeJob) -> QuantizeResult:
    import json
    from dataclasses import replace

    import torch

    from quantkit.engines.transformers import torch_dtype
    from quantkit.mlx.checkpoint import (ShardedWriter, dropped_names, expert_stacks, fused_tensor, keeps_dtype,
                                         mlx_config, mtp_layers, per_expert_info, per_expert_source,
                                         quantization_block, written_fused, written_name, written_tensor)

    job = replace(job, info=per_expert_info(job.info))  # experts stored fused: as the per-expert checkpoint's
    opts = job.options
    plan = layer_plan(job.info, opts, job.ignore)
    imp = {}
    if opts.calibrate:
        calib = job.windows.calib
        job.progress(f"column importances: {len(calib)} calibration windows through the model")
        imp = column_importance(job)
        freed()  # the calibration forward's weights and activations, before the weights are read to be written
    dtype = torch_dtype(job.dtype, job.info)
    source, writer = per_expert_source(job.info), ShardedWriter(job.out_dir)
    mtp = mtp_layers(job.info.config, source.keys())
    stacks = expert_stacks(job.info.config, [name for name in source.keys() if not name.startswith(mtp)])
    first = {names[0]: module for module, names in stacks.items()}  # a stack is written where its first expert was
    members = {name for names in stacks.values() for name in names}
    dropped = set(dropped_names(job.info.config, source.keys()))
    job.progress(f"writing {sum(p is not None for p in plan.values())} quantized modules")
    for tensor in source.keys():  # noqa: SIM118  (a WeightSource, not a dict)
        if fused_tensor(job.info.config, tensor) is not None:  # cut into the SwitchGLU's projections
            for name, value in written_fused(job.info.config, tensor, source.get(tensor)).items():
                write_module(job, writer, name, value, plan, imp, dtype)
            continue
        if tensor in first:
            module = first[tensor]
            weight = torch.stack([source.get(name) for name in stacks[module]])
        elif tensor in members or tensor.startswith(mtp) or tensor in dropped:
            continue
        else:
            module, weight = tensor.removesuffix(".weight"), source.get(tensor)
        if plan.get(module) is None or not tensor.endswith(".weight"):
            cast = weight.is_floating_point() and not keeps_dtype(job.info.config, tensor)
            name = module + ".weight" if tensor in first else tensor
            value = written_tensor(job.info.config, name, weight.to(dtype) if cast else weight)
            writer.add(written_name(job.info.config, name), value)
            continue
        for name, value in quantized_module(job, module, weight, plan[module], imp, dtype).items():
            writer.add(written_name(job.info.config, name), value)
    files = writer.close()
    default = Precision(opts.bits, opts.group_size)
    block = quantization_block(default, {written_name(job.info.config, m): p for m, p in plan.items()})
    (job.out_dir / "config.json").write_text(json.dumps(mlx_config(job.info.config, block), indent=4) + "\n")
    counts: dict[str, int] = {}
    for p in plan.values():
        key = f"{p.bits}-bit" if p else KEEP
        counts[key] = counts.get(key, 0) + 1
    return QuantizeResult(job.out_dir, {"mlx": {
        "files": files, "bits": opts.bits, "group_size": opts.group_size, "mode": "affine", "modules": counts,
        "scales": "calibrated: importance-weighted least squares per group" if opts.calibrate else "min/max rounding",
        "calibration_tokens": int(job.windows.calib.numel()) if opts.calibrate else 0},
        **mtp_not_written(job.info, sorted(dropped))})


def write_module(job: QuantizeJob, writer, name: str, value, plan: dict, imp: dict, dtype) -> None:
    """One tensor of a fused expert tensor's pieces written: a weight the plan quantizes as its module's quantized
    tensors, anything else cast to the run's dtype."""
    from quantkit.mlx.checkpoint import written_name

    module = name.removesuffix(".weight")
    if name.endswith(".weight") and plan.get(module) is not None:
        for stored, part in quantized_module(job, module, value, plan[module], imp, dtype).items():
            writer.add(written_name(job.info.config, stored), part)
    else:
        writer.add(written_name(job.info.config, name), value.to(dtype))


def mtp_not_written(info, dropped: list[str]) -> dict:
    """The report's word on the checkpoint's tensors its mlx-lm model has no module for (Qwen3.5's `mtp.*`, which
    mlx-lm's qwen3_5 sanitize drops): not written."""
    if not dropped:
        return {}
    return {"mtp_layers": f"not written: {len(dropped)} mtp.* tensors; mlx-lm's {mlx_model(info)} model has no MTP "
                          "layer (its sanitize drops them), so the artifact holds the model mlx-lm runs "
                          "(compressed-tensors methods carry them as stored, GGUF as llama.cpp's nextn block)"}


def mlx_model(info) -> str:
    from quantkit.arch.families import of_config

    family = of_config(info.config)
    return family.mlx if family is not None else info.model_type


def freed() -> None:
    """What the calibration forward left (its model's reference cycles, the heap's free pages) handed back."""
    import gc

    from quantkit.io.memory import release_freed_memory

    gc.collect()
    release_freed_memory()


def quantized_module(job: QuantizeJob, module: str, weight, chosen: Precision, imp: dict, dtype) -> dict:
    """The stored tensors of one quantized module (quantkit.mlx.checkpoint.quantized_tensors): a stacked expert
    projection (3-D) expert by expert, each with its own column importances."""
    from quantkit.mlx import affine
    from quantkit.mlx.checkpoint import quantized_tensors

    weights = importance_of(module, imp, job.info) if job.options.calibrate else None
    if job.options.calibrate and weights is None and not is_embedding(module, job.info):
        from quantkit.errors import InternalError

        raise InternalError(f"mlx: no calibration activations reached {module}")
    quantizer = affine.quantize_stacked if weight.dim() == 3 else affine.quantize
    return quantized_tensors(module, *quantizer(weight, chosen.bits, chosen.group_size, weights, dtype))


def working_set(info, options: Options) -> int:
    """The larger of the calibration pass (one float32 tensor streamed at a time with a group of windows'
    activations) and the writing (one weight read whole and in float32 with its quantized copy, the
    search's temporaries on one slab of it, a shard's tensors waiting to be written); a mixture's largest
    weight is a stacked expert projection, every expert of it."""
    import math

    from quantkit.eval.stream import ACTIVATION_BYTES
    from quantkit.mlx.affine import SLAB_VALUES
    from quantkit.mlx.checkpoint import SHARD_BYTES, expert_stacks, per_expert_info

    info = per_expert_info(info)
    largest = max((math.prod(shape) for _dtype, shape in info.tensors.values()), default=0)
    stacks = expert_stacks(info.config, info.tensors)  # a stacked expert projection is read and quantized whole
    written = max([largest, *(sum(math.prod(info.tensors[n][1]) for n in names) for names in stacks.values())])
    calibrating = 2 * 4 * largest + ACTIVATION_BYTES if options.calibrate else 0
    return max(calibrating, 2 * 4 * written + 12 * 4 * SLAB_VALUES + SHARD_BYTES)


def stored_bits(options: Options) -> float:
    return options.bits + 32 / options.group_size  # a 16-bit scale and bias per group


def precision_bits(options: Options, text: str) -> float:
    """Bits per weight of a plan entry ("mlx affine 4-bit g64 (calibrated)": 4.5)."""
    match = re.match(r"mlx affine (\d+)-bit g(\d+)", text)
    return int(match.group(1)) + 32 / int(match.group(2))


# why a torchrun launch is refused: nothing of the work is split between ranks
RANKS_REFUSED = "quantkit's MLX conversion writes the checkpoint in one process (MLX has no torchrun ranks)"


ROTATION_REFUSED = ("an mlx-lm checkpoint stores no transform and mlx-lm applies none, and quantkit's MLX "
                    "conversion does not run llm-compressor's transform modifiers")


AUTO_RUNGS = tuple(AutoRung(f"mlx {b}-bit", (("bits", b),), "mlx") for b in (2, 3, 4, 6, 8))  # --method auto

METHOD = MethodSpec(
    name="mlx", format=mlx_format.FORMAT, label="MLX (mlx-lm affine quantized)",
    scheme=lambda options: f"affine {options.bits}-bit g{options.group_size}", engine="quantkit-mlx",
    engine_package="quantkit", options=Options, quantize=quantize, precision=precision, default_gate=default_gate,
    check=check, needs_calibration=needs_calibration,
    needs_model=lambda info, options: False,  # reads the checkpoint; the importances stream it
    support=support, rotation_refused=ROTATION_REFUSED,
    layers=Layers(keeps_lm_head=lambda options: False,  # quantized as mlx_lm.convert does (--ignore lm_head keeps it)
                  exact_types=exact_types, check_ignore=check_ignore,
                  quantizes_fused_experts=lambda info, options: True),  # its SwitchGLU quantizes every expert
    sizes=Sizes(stored_bits=stored_bits, working_set=working_set, precision_bits=precision_bits),
    ranks=OnRanks(lambda options: RANKS_REFUSED),  # converts in one process: refused on ranks, saying why,
    auto=AUTO_RUNGS,
)
