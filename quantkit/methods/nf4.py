"""bitsandbytes 4-bit NF4/FP4 (and LLM.int8) through transformers, saved as a bnb checkpoint.

For QLoRA training and quick experiments: the checkpoint reloads with a plain
`from_pretrained` (transformers + bitsandbytes, GPU or CPU) and is the base a QLoRA adapter
is trained against. It is not a fast serving format; use gptq/awq/fp8 for vLLM.

Needs no calibration data: NF4 is blockwise absmax (64 weights per block) onto a fixed
16-value code book. The checkpoint is loaded with a BitsAndBytesConfig, which is how transformers
quantizes with bitsandbytes; the pipeline does not load the 16-bit model for this method.

`fallback` (gate-driven, quantkit.run.pipeline.run_fallback): the Linear layers whose rounding is predicted
to cost the most (bitsandbytes' own quantize/dequantize of each weight, weighted by the calibration
windows' input statistics and scaled by KL divergences measured on a few probe layers,
quantkit.mixed.layers) are added to `llm_int8_skip_modules` (16-bit), a few more each step, until the
gate passes or `max_size` is spent.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.arch.moe import is_expert_weight
from quantkit.errors import UnsupportedError, require
from quantkit.formats import bitsandbytes
from quantkit.methods import AutoRung, FallbackSteps, Layers, MethodSpec, OnRanks, QuantizeJob, QuantizeResult, Sizes, fixed_gate
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import Fallback

# NF4 is plain round-to-nearest onto 16 levels, without calibration: looser than GPTQ/AWQ.
DEFAULT_GATE = {"max_ppl_increase": 0.15, "max_kld": 0.15, "min_top1": 0.75}

COMPUTE_DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZED_ROLES = ("decoder", "other")
BLOCK_SIZE = 64  # bitsandbytes 4-bit blocksize used by transformers
# bitsandbytes' CPU 4-bit matmul (on AVX512-BF16 machines) repacks each weight on the first
# forward (functional._convert_weight_packed_for_cpu): out_features must be a multiple of its
# block_n (32) and in_features of the 64-weight block (absmax reshaped to [out, in // 64]).
# Other shapes fail inside bitsandbytes, so such layers stay 16-bit on every machine.
CPU_BLOCK_N = 32
# MoE routed experts stay 16-bit: transformers 5 holds them fused as 3-D parameters (not nn.Linear),
# which its bitsandbytes integration does not quantize (`kept_moe_experts` in the report).


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scheme: Literal["nf4", "fp4", "int8"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto: the model's dtype
    fallback: Fallback | None = None  # on a failed gate, keep the most damaging layers 16-bit (quantkit.mixed.budget)


def needs_calibration(options: Options) -> bool:
    """Only a fallback's sensitivity pass: NF4 itself needs no data."""
    return options.fallback is not None


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in QUANTIZED_ROLES or is_expert_weight(name):  # experts: exact_types
        return None
    return linear_precision(options, shape)


def exact_types(info, options: Options) -> dict[str, str]:
    """The plan's entries of the experts split_experts writes one Linear per expert projection (Llama 4's), each at
    the precision of a Linear of its shape; {} for any other model."""
    return {module: text for module, shape in split_modules(info).items() if (text := linear_precision(options, shape))}


def linear_precision(options: Options, shape: list[int]) -> str | None:
    """A quantized Linear's precision text, None where the kernels cannot take its shape (it stays 16-bit)."""
    if not fits_kernels(options, shape):
        return None
    if options.scheme == "int8":
        return "int8 per-row absmax (LLM.int8, bitsandbytes)"
    dq = " + double quant" if options.double_quant else ""
    return f"{options.scheme} blocks of {BLOCK_SIZE}{dq} (bitsandbytes)"


def check(info, options: Options, calibration) -> None:
    """bitsandbytes installed, an MoE layout transformers reloads, and at least one layer it can
    quantize (odd shapes stay 16-bit)."""
    from quantkit.arch.moe import check_supported

    require("bitsandbytes", "nf4", "the nf4 method (bitsandbytes 4-bit)")
    if not known_experts(info):
        check_supported(info, "nf4")  # an unknown layout may not reload as bitsandbytes saved it
    layers = quantizable_layers(info)
    if layers and not any(fits_kernels(options, shape) for shape in layers.values()):
        name, shape = next(iter(layers.items()))
        raise UnsupportedError(
            f"no layer of {info.path} fits bitsandbytes' {options.scheme} kernels (e.g. {name} {shape}): "
            f"4-bit needs out_features % {CPU_BLOCK_N} == 0 and in_features % {BLOCK_SIZE} == 0",
            hint="use gguf or fp8 for this model")
    if options.fallback is not None:
        from quantkit.mixed.budget import check_max_size

        intmix.check_streamable(info, "nf4: fallback", "--fallback")
        check_max_size(options.fallback, intmix.artifact_estimate(info, fallback_layers(info, options, []),
                                                                  sized_for(options), options.scheme), "nf4 fallback")


def known_experts(info) -> bool:
    """A text mixture of experts whose family's record says how its experts are stored (an expert layout, or
    experts fused across experts: mlx_experts.fused), so the artifact reloads as it is saved: experts fused as
    transformers holds them stay 16-bit, and where transformers' bitsandbytes reload builds one Linear per expert
    projection, each is written so (split_experts: Llama 4); its stored experts checked complete."""
    from quantkit.arch.families import of_config
    from quantkit.arch.moe import check_experts_stored, expert_count
    from quantkit.arch.vlm import is_vlm

    family = of_config(info.config)
    if not expert_count(info.config) or is_vlm(info.config) or family is None or not stores_experts_known(family):
        return False
    check_experts_stored(info)
    return True


def stores_experts_known(family) -> bool:
    return family.moe is not None or (family.mlx_experts is not None and bool(family.mlx_experts.fused))


def moe_model_types() -> list[str]:
    """The mixture-of-experts model types nf4 takes (known_experts), for docs/models.md."""
    from quantkit.arch.families import all_families

    return sorted({f.model_type for f in all_families() if stores_experts_known(f)})


def reload_splits(info) -> list[str]:
    """The fused-experts classes of this model that transformers' bitsandbytes reload builds one Linear per expert
    projection (transformers.quantizers.base.MODULES_TO_PATCH_FOR_QUANTIZATION: Llama 4's Llama4TextExperts, as
    SequentialLlama4TextExperts of Llama4TextMLP): those its model's module defines."""
    import importlib

    import transformers
    from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION
    from transformers.utils.quantization_config import QuantizationMethod

    model_class = getattr(transformers, info.architecture, None)
    defined = vars(importlib.import_module(model_class.__module__)) if model_class is not None else {}
    return [name for name, row in MODULES_TO_PATCH_FOR_QUANTIZATION.items()
            if name in defined and QuantizationMethod.BITS_AND_BYTES in row["quantization_methods"]]


def split_modules(info) -> dict[str, list[int]]:
    """{expert projection module: [out, in]} of the fused experts split_experts writes one Linear per expert
    projection (`model.layers.1.feed_forward.experts.0.gate_proj`), cut as the family record's mlx_experts.fused
    says they are fused (quantkit.arch.moe.fused_expert_linears); {} for a model whose experts transformers reloads
    fused (reload_splits)."""
    from quantkit.arch.moe import fused_expert_linears

    linears = fused_expert_linears(info.config, info.tensors)
    if not linears or not reload_splits(info):
        return {}
    return {module: shape for module, (_fused, shape) in linears.items()}


def quantizable_layers(info) -> dict[str, list[int]]:
    """{module name: [out, in]} of the linear weights nf4 quantizes (by role)."""
    from quantkit.arch.roles import classify, linear_weights

    return {n: s for n, s in linear_weights(info).items() if classify(n + ".weight", info.towers) in QUANTIZED_ROLES}


def fits_kernels(options: Options, shape: list[int]) -> bool:
    """Whether bitsandbytes can run this [out_features, in_features] weight in 4-bit on CPU."""
    if options.scheme == "int8":
        return True
    out_features, in_features = shape
    return out_features % CPU_BLOCK_N == 0 and in_features % BLOCK_SIZE == 0


def kept_for_kernels(info, options: Options) -> list[str]:
    """Quantizable layers whose shape bitsandbytes' kernels cannot take (kept 16-bit)."""
    return [name for name, shape in quantizable_layers(info).items() if not fits_kernels(options, shape)]


def exact_module(name: str) -> str:
    """A transformers skip pattern for one module, robust to the VLM checkpoint-vs-module renaming:
    the name from its layer stack on (`layers.3.mlp.down_proj`), anchored at a dot and the end."""
    parts = name.split(".")
    start = next((i - 1 for i, part in enumerate(parts) if part.isdigit() and i > 0), 0)
    return rf"(.*\.)?{re.escape('.'.join(parts[start:]))}$"


def compute_dtype(options: Options, model_dtype):
    import torch

    if options.compute_dtype == "auto":
        return model_dtype
    return getattr(torch, options.compute_dtype)


def bnb_config(options: Options, dtype, skip: list[str]):
    """transformers BitsAndBytesConfig for the options; `skip` modules stay 16-bit."""
    from transformers import BitsAndBytesConfig

    if options.scheme == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=options.scheme,
        bnb_4bit_use_double_quant=options.double_quant,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=skip,
    )


def skip_modules(ignore: list[str]) -> list[str]:
    """llm-compressor ignore patterns -> transformers skip patterns (re.match, or name suffix)."""
    return [p[3:] if p.startswith("re:") else p for p in ignore]


def quantize(job: QuantizeJob) -> QuantizeResult:
    return write(job, [])


def write(job: QuantizeJob, kept: list[str]) -> QuantizeResult:
    """The checkpoint loaded with a bitsandbytes config and saved; `kept` layers stay 16-bit too (a
    fallback plan)."""
    from quantkit.arch.roles import matches
    from quantkit.engines.patches import plain_writes
    from quantkit.engines.transformers import torch_dtype

    require("bitsandbytes", "nf4", "the nf4 method (bitsandbytes 4-bit)")
    dtype = torch_dtype(job.dtype, job.info)
    odd = kept_for_kernels(job.info, job.options)
    split = split_modules(job.info)
    odd_experts = sorted(n for n, shape in split.items() if not fits_kernels(job.options, shape)
                         or matches(n, job.ignore))
    skip = skip_modules(job.ignore) + [exact_module(name) for name in [*odd, *kept, *odd_experts]]
    config = bnb_config(job.options, compute_dtype(job.options, dtype), skip)
    model = load_quantized(job.info, dtype, config, job.device, job.trust_remote_code)
    quantized_experts = split_experts(model, job.info, config, set(odd_experts)) if split else 0
    with plain_writes():  # no memory map of the output beside the model (quantkit.io.shards.save_file)
        model.save_pretrained(job.out_dir)  # the tokenizer files are copied beside it by the pipeline
    details = {"bnb_quantization_config": model.config.quantization_config.to_dict(),
               "kept_for_bnb_kernels": odd,
               "kept_moe_experts": len([n for n in quantizable_layers(job.info) if is_expert_weight(n)]),
               **({"split_moe_experts": {"quantized": quantized_experts, "kept_16bit": odd_experts}} if split else
                  fused_experts_kept(job.info)),
               **mtp_not_written(job.info)}
    del model
    return QuantizeResult(job.out_dir, details)


def fused_experts_kept(info) -> dict:
    """The report's word on experts stored fused across experts (quantkit.arch.moe.fused_expert_linears: GPT-OSS's
    gate_up_proj, Granite 4's input_linear.weight), which transformers' bitsandbytes integration does not quantize:
    the fused tensors' names, kept 16-bit."""
    from quantkit.arch.moe import fused_expert_linears

    names = sorted({tensor for tensor, _shape in fused_expert_linears(info.config, info.tensors).values()})
    return {"kept_fused_experts": names} if names else {}


def split_experts(model, info, config, kept: set[str]) -> int:
    """Each fused-experts module of the loaded model that transformers' bitsandbytes reload builds one Linear per
    expert projection (reload_splits) replaced by the module it builds, each expert's projections cut from the fused
    tensors (quantkit.mlx.checkpoint.fused_pieces, as the family record's mlx_experts.fused says) and quantized as
    transformers quantizes a Linear while loading (its replace_with_bnb_linear and Params4bit / Int8Params), those in
    `kept` (module names) left 16-bit; the number of expert projections quantized."""
    from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION

    from quantkit.arch.families import of_config

    classes = reload_splits(info)
    fused = of_config(info.config).mlx_experts.fused if classes else ()
    quantized = 0
    for name, module in [(n, m) for n, m in model.named_modules() if type(m).__name__ in classes]:
        builder = MODULES_TO_PATCH_FOR_QUANTIZATION[type(module).__name__]["module_name"]
        weights, device = expert_weights(module, fused), next(module.parameters()).device
        split = expert_linears(builder, model.config.get_text_config(), config,
                               [n for n in weights if f"{name}.{n}" in kept])
        for piece, value in weights.items():
            quantized += set_weight(split.get_submodule(piece), value.to(device))
        model.set_submodule(name, split)
    return quantized


def expert_weights(module, fused) -> dict:
    """{'<expert>.<projection>': its F.linear weight [out, in]} of a fused-experts module's tensors, cut by the
    family's FusedExperts rows (their tensor's last name part the module's parameter)."""
    from quantkit.mlx.checkpoint import fused_pieces

    out = {}
    for row in fused:
        pieces = fused_pieces(row, getattr(module, row.tensor.rsplit(".", 1)[-1]).data, bias=False)
        for projection, stacked in zip(row.projections, pieces, strict=True):
            out |= {f"{e}.{projection}": stacked[e].contiguous() for e in range(stacked.shape[0])}
    return out


def expert_linears(builder, text_config, config, kept: list[str]):
    """transformers' per-expert module (`builder`) on the meta device with its Linears replaced by bitsandbytes'
    as transformers replaces them while loading, those in `kept` (names within it) left Linear."""
    import torch
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    with torch.device("meta"):
        split = builder(text_config)
    return replace_with_bnb_linear(split, modules_to_not_convert=kept or None, quantization_config=config)


def set_weight(linear, value) -> int:
    """A Linear's weight set to `value`, quantized where it is a bitsandbytes layer (transformers' Bnb4bitQuantize
    / Bnb8bitQuantize: the parameter rebuilt from the meta one's attributes, quantized on its move to the device);
    1 where it was quantized."""
    import bitsandbytes as bnb
    import torch

    old = linear.weight
    if isinstance(old, bnb.nn.Params4bit):
        linear.weight = bnb.nn.Params4bit(value, requires_grad=False, **old.__dict__).to(value.device)
    elif isinstance(old, bnb.nn.Int8Params):
        kwargs = {k: v for k, v in old.__dict__.items() if k != "SCB"}
        linear.weight = bnb.nn.Int8Params(value.to("cpu"), requires_grad=False, **kwargs).to(value.device)
    else:
        linear.weight = torch.nn.Parameter(value, requires_grad=False)
        return 0
    return 1


def mtp_not_written(info) -> dict:
    """The report's word on a checkpoint's multi-token-prediction tensors (`mtp.*`, Qwen3.5): transformers'
    model has no module for them, so the bitsandbytes checkpoint it saves holds none."""
    names = [n for n in info.tensors if n.startswith("mtp.")]
    if not names:
        return {}
    return {"mtp_layers": f"not written: {len(names)} mtp.* tensors; transformers loads no MTP layer, and its "
                          "bitsandbytes checkpoint holds the model it loads (compressed-tensors methods carry them "
                          "as stored, GGUF as llama.cpp's nextn block)"}


def load_quantized(info, dtype, config, device: str, trust_remote_code: bool = False):
    """Re-load the checkpoint with the bitsandbytes config: transformers quantizes while loading."""
    from quantkit.engines.transformers import auto_model_class, device_map
    from quantkit.io.offline import offline

    with offline():
        model = auto_model_class(info.config).from_pretrained(
            info.path, dtype=dtype, quantization_config=config, use_safetensors=True,
            local_files_only=True, device_map=device_map(device), trust_remote_code=trust_remote_code,
        )
    return model.eval()


# ---------------------------------------------------------------- gate-driven fallback


def layer_bytes(shape: tuple[int, int], precision: str, element: int = 2, double_quant: bool = True) -> int:
    """A Linear's stored bytes: 4 bits per weight and one absmax per block of 64 (one byte with double
    quantization, float32 without; LLM.int8: a byte per weight and a float32 scale per row), or the model's
    dtype (`element` bytes); plus the room its name takes in the skip list and the header."""
    out, inp = shape
    if precision == "16-bit":
        stored = out * inp * element
    elif precision == "int8":
        stored = out * inp + out * 4
    else:
        stored = out * inp // 2 + out * inp // BLOCK_SIZE * (1 if double_quant else 4)
    return stored + intmix.METADATA_BYTES


def sized_for(options: Options, element: int = 2):
    return lambda shape, precision: layer_bytes(shape, precision, element, options.double_quant)


def fallback_layers(info, options: Options, ignore: list[str]) -> dict[str, tuple[int, int]]:
    """The layers the plain artifact quantizes (kernel shapes fit, routed experts and `ignore` left out)."""
    from quantkit.arch.roles import matches

    return {name: tuple(shape) for name, shape in quantizable_layers(info).items()
            if fits_kernels(options, shape) and not is_expert_weight(name) and not matches(name, ignore)}


def simulation(options: Options, dtype) -> intmix.Simulation:
    """bitsandbytes' rounding of one weight, in the model's dtype as transformers hands it over: 4-bit blocks
    of 64 (double quantization as asked) or LLM.int8's per-row absmax (its outlier columns, computed in
    16-bit at run time, are not simulated)."""

    def weight(layer, precision, source):
        import bitsandbytes.functional as bnb

        w = source.to(dtype)
        if options.scheme == "int8":
            scale = w.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
            return (w.float() / scale).round().clamp(-127, 127) * scale
        packed, state = bnb.quantize_4bit(w, blocksize=BLOCK_SIZE, compress_statistics=options.double_quant,
                                          quant_type=options.scheme)
        return bnb.dequantize_4bit(packed, state).float()

    return intmix.Simulation((options.scheme,), weight)


def fallback_ladder(job: QuantizeJob, result: QuantizeResult):
    from quantkit.engines.transformers import torch_dtype

    dtype = torch_dtype(job.dtype, job.info)
    return intmix.keep_ladder(job, fallback_layers(job.info, job.options, job.ignore), simulation(job.options, dtype),
                              sized_for(job.options, dtype.itemsize))


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """The checkpoint quantized again with the plan's 16-bit layers skipped."""
    from quantkit.engines.llmcompressor.llmc import clear_weights
    from quantkit.engines.transformers import torch_dtype

    clear_weights(job.out_dir)
    result = write(job, intmix.kept_16bit(plan))
    size = sized_for(job.options, torch_dtype(job.dtype, job.info).itemsize)
    return QuantizeResult(result.artifact, {**details, **result.details,
                                            "mixed_precision": intmix.keep_report(details, plan, size)})


def working_set(info, options: Options) -> int:
    """What loading the checkpoint with the bitsandbytes config holds (needs_model is False: the run loads no model
    for it): the decoder layers at stored_bits, every tensor outside them (the embedding table, norms, the head kept
    16-bit) as stored, and one decoder layer in 16 bits while it is quantized."""
    from quantkit.io.checkpoint import unit_bytes

    others, layers = unit_bytes(info)
    return sum(others.values()) + int(sum(layers.values()) * stored_bits(options) / 16) + max(layers.values(), default=0)


def stored_bits(options: Options) -> float:
    """NF4/FP4 with one absmax per 64 weights (double-quantized: 8 bits and a share of a second level), or int8."""
    return 8.0 if options.scheme == "int8" else 4.127


def support(family) -> str:
    return family.decoder_support("✅ experts stay bf16")


# why a torchrun launch is refused: nothing of the work is split between ranks
RANKS_REFUSED = "bitsandbytes quantizes the weights as transformers loads the checkpoint, in one process"


ROTATION_REFUSED = ("a bitsandbytes checkpoint stores no transform and transformers applies none when it loads "
                    "one; bitsandbytes quantizes as transformers loads the model, outside llm-compressor")


AUTO_RUNGS = (AutoRung("bitsandbytes int8", (("scheme", "int8"),), "bitsandbytes"),
              AutoRung("bitsandbytes nf4", (("scheme", "nf4"),), "bitsandbytes"))

METHOD = MethodSpec(
    name="nf4", format=bitsandbytes.FORMAT, label="transformers bitsandbytes checkpoint (4-bit NF4/FP4 or LLM.int8)",
    scheme=lambda options: options.scheme, engine="bitsandbytes", options=Options, quantize=quantize,
    precision=precision, default_gate=fixed_gate(DEFAULT_GATE), check=check, needs_calibration=needs_calibration,
    needs_model=lambda info, options: False,  # transformers re-loads the checkpoint with a bnb config
    support=support, rotation_refused=ROTATION_REFUSED,
    layers=Layers(exact_types=exact_types, quantizes_fused_experts=lambda info, options: bool(reload_splits(info))),
    sizes=Sizes(stored_bits=stored_bits, working_set=working_set),
    fallback=FallbackSteps(fallback_ladder, requantize),
    ranks=OnRanks(lambda options: RANKS_REFUSED),  # converts in one process: refused on ranks, saying why,
    auto=AUTO_RUNGS,
)
