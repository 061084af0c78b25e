"""GGUF k-quants for llama.cpp / Ollama: quantkit's own HF->GGUF converter, mixtures and kernels.

Writes `<model-name>-<TYPE>.gguf` and an Ollama `Modelfile` into the output directory. The
per-tensor types follow llama-quantize's mixture rules (quantkit.gguf.mixture); with the same
input values and imatrix the tensor bytes equal llama-quantize's.

imatrix: "none", a path to an imatrix file (llama.cpp GGUF or legacy .dat), or "auto": computed
from the calibration windows when the type benefits from it. llama.cpp users apply an imatrix to
everything at 4 bits and below (it lowers Q4_K_M's KLD by ~10% and Q2_K/Q3_K's by 20-30% in
llama.cpp's perplexity README); at Q5_K and above the gain is within noise and Q8_0 ignores it.
So auto = on for Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q4_0, Q4_1 and every i-quant mix (IQ4_XS ... IQ1_M:
llama.cpp made them for use with an imatrix, and refuses IQ3_XXS, IQ2_* and IQ1_* tensors without
one); off otherwise. With imatrix "none", a mix whose tensors need one is refused before any work.

A VLM gets two files, as llama.cpp runs one: the language model (quantized as above) and its
vision tower + projector as `mmproj-<model-name>-<TYPE>.gguf` (quantkit.gguf.mmproj: 16-bit, byte
for byte what llama.cpp's converter writes), and a Modelfile naming both. `mmproj` chooses that
file's type (auto: the source's 16-bit type, as llama.cpp's converter does without --outtype;
f16, bf16, f32), or "none": the language model alone, which then cannot read images; a VLM family
without an mmproj conversion is refused unless that is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quantkit.errors import InputError, UnsupportedError
from quantkit.formats import gguf as gguf_format
from quantkit.methods import AutoRung, FallbackSteps, Layers, MethodSpec, OnRanks, QuantizeJob, QuantizeResult, Resume, Sizes, Towers
from quantkit.mixed.budget import Fallback

MIX_MARGIN = 1.15  # mixtures give some tensors more bits than the base type (Q4_K_M: Q6_K parts)

# k-quants lose more than FP8: gate on KLD and top-1 agreement, leave PPL to the recipe.
DEFAULT_GATE = {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80}  # the Q4 mixes
# Default gates by bits: 8-bit and up near-lossless, each step down looser (llama.cpp's own KLD
# tables show roughly this ordering: Q8_0 << Q6_K < Q5_K_M < Q4_K_M < Q3_K_M < Q2_K).
GATE_BY_PREFIX = (
    (("F32", "F16", "BF16", "Q8_0", "Q6_K"), {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95}),
    (("Q5",), {"max_ppl_increase": 0.05, "max_kld": 0.03, "min_top1": 0.90}),
    (("Q4", "IQ4"), DEFAULT_GATE),
    (("Q3", "IQ3"), {"max_ppl_increase": 0.20, "max_kld": 0.20, "min_top1": 0.70}),
    (("Q2", "IQ2", "IQ1"), {"max_ppl_increase": 0.40, "max_kld": 0.40, "min_top1": 0.60}),
)
TENSOR_TYPES_FILE = "tensor-types.txt"  # llama-quantize --tensor-type-file reproducing per-tensor types
IMATRIX_AUTO_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q4_0", "Q4_1",
                      "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                      "IQ2_M", "IQ1_S", "IQ1_M")


class AutoPrecision(BaseModel):
    """Per-tensor k-quant types chosen by measured sensitivity under a size budget."""

    model_config = ConfigDict(extra="forbid")
    budget_bpw: float | None = Field(None, gt=1, le=16, description="bits per weight of the whole file; "
                                     "default: the size of llama.cpp's mixture for gguf_type")
    measure_windows: int = Field(8, ge=0, le=1024, description="calibration windows the probe tensors' KL "
                                 "divergence is measured on (0: imatrix-weighted error only)")
    probes_per_role: int = Field(3, ge=1, le=64, description="tensors of each role (attn_q, ffn_down, ...) whose "
                                 "KL divergence is measured, spread over depth; the others' are interpolated")


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gguf_type: str = "Q4_K_M"
    imatrix: str = "auto"  # "auto" | "none" | path to an imatrix file
    auto_precision: AutoPrecision | None = None
    fallback: Fallback | None = None
    mmproj: Literal["auto", "f16", "bf16", "f32", "none"] = Field(
        "auto", description="a VLM's vision tower + projector as llama.cpp's mmproj .gguf: auto (the source's "
        "16-bit type, as convert_hf_to_gguf.py --mmproj), f16, bf16, f32; none: the language model alone")

    @field_validator("gguf_type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        from quantkit.gguf.mixture import file_type

        try:
            name, _, default = file_type(value)
        except InputError as exc:
            raise ValueError(f"{exc.message}; {exc.hint}") from None
        missing_kernel(name, {"": default})
        return name

    @model_validator(mode="after")
    def _quantized_type(self) -> "Options":
        if mixed(self) and self.gguf_type in ("F32", "F16", "BF16"):
            raise ValueError(f"auto_precision / fallback choose quantized types; {self.gguf_type} is not quantized")
        return self


def missing_kernel(gguf_type: str, types: dict) -> None:
    """UnsupportedError when the mix's types include one quantkit has no kernel for (quantkit.gguf.quants)."""
    from quantkit.gguf.mixture import missing_kernels
    from quantkit.gguf.quants import SUPPORTED

    missing = missing_kernels(types, SUPPORTED)
    if missing:
        raise UnsupportedError(f"GGUF type {gguf_type} uses {', '.join(missing)}, which quantkit has no "
                               "quantization kernel for yet",
                               hint="choose a mix whose types quantkit quantizes (quantkit.gguf.quants.SUPPORTED)")


def check_mix(info, options: Options, imatrix_entries=None) -> None:
    """Before any work: every type the mix gives this model's tensors has a kernel, and with imatrix
    "none" no tensor needs an imatrix (llama.cpp refuses IQ3_XXS, IQ2_* and IQ1_* tensors without one);
    an imatrix file (`imatrix_entries`: its tensor names) has an entry for each tensor that needs one."""
    from quantkit.gguf.mixture import needs_imatrix

    plans = model_plans(info, options.gguf_type, uses_imatrix(options))
    types = {p.name: p.qtype for p in plans}
    missing_kernel(options.gguf_type, types)
    needing = needs_imatrix(types)
    if needing and not uses_imatrix(options):
        raise InputError(f"GGUF type {options.gguf_type} needs an importance matrix: llama.cpp refuses to "
                         f"quantize {len(needing)} of its tensors (e.g. {needing[0]} as "
                         f"{types[needing[0]].name}) without one",
                         hint="pass --imatrix auto (computed from the calibration windows) or --imatrix FILE")
    uncovered = [n for n in needing if imatrix_entries is not None and n not in imatrix_entries]
    if uncovered:
        raise InputError(f"imatrix {options.imatrix} has no entry for {uncovered[0]}, which GGUF type "
                         f"{options.gguf_type} makes {types[uncovered[0]].name}: llama.cpp refuses that without one",
                         hint="compute the imatrix on this model (--imatrix auto)")


def mixed(options: "Options") -> bool:
    """Per-tensor types are chosen by quantkit (auto_precision), or may be raised (fallback)."""
    return options.auto_precision is not None or options.fallback is not None


def measures(options: "Options") -> bool:
    """Whether the per-tensor types are measured in KL divergence through the streamed forward: auto_precision's
    probes (measure_windows > 0), or the fallback's (which takes auto_precision's settings, else its defaults)."""
    auto = options.auto_precision or AutoPrecision()
    return mixed(options) and auto.measure_windows > 0


def default_gate(options: "Options") -> dict:
    for prefixes, gate in GATE_BY_PREFIX:
        if options.gguf_type.startswith(prefixes):
            return gate
    return DEFAULT_GATE


def uses_imatrix(options: Options) -> bool:
    return options.imatrix != "none" and (options.imatrix != "auto" or options.gguf_type in IMATRIX_AUTO_TYPES)


def computes_imatrix(options: Options) -> bool:
    """The imatrix is computed here (from the calibration windows, with the model in memory)."""
    return options.imatrix == "auto" and uses_imatrix(options)


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    """The per-role default GGUF type of one weight, marked "(… mix)" for decoder weights.

    Only a default: the mixture needs the whole tensor list (attn_v / ffn_down depend on the
    layer index and the layer count), so the plan takes each weight's exact type from
    `plan_types` and falls back to this where the architecture cannot be converted.
    """
    from quantkit.gguf.mixture import FILE_TYPES, OUTPUT_Q5_K, T, fallback

    default = FILE_TYPES[options.gguf_type][1]
    if default in (T.F32, T.F16, T.BF16):
        return f"gguf {default.name}"
    if role == "lm_head":
        qtype = T.Q8_0 if default == T.Q8_0 else T.Q5_K if options.gguf_type in OUTPUT_Q5_K else T.Q6_K
    else:
        qtype = default
    qtype = fallback(qtype, shape[-1] if shape else 0)
    suffix = f" ({options.gguf_type} mix)" if role == "decoder" else ""
    return f"gguf {qtype.name}{suffix}"


def plan_types(info, options: Options) -> dict[str, str]:
    """Exact type of every weight as llama-quantize's mixture gives it.

    Keys are module names as quantkit.run.plan names them (the tensor name without ".weight"),
    values "gguf <TYPE>" (e.g. "gguf Q6_K"). Empty when the architecture cannot be converted.
    """
    from quantkit.gguf.convert import plan_tensors

    try:
        plans = plan_tensors(info.config, info.tensors, options.gguf_type, uses_imatrix(options))
    except UnsupportedError:
        return {}
    types = {name.removesuffix(".weight"): f"gguf {p.qtype.name}"  # a stacked expert tensor: each expert's source
             for p in plans for name in (p.sources or (p.hf_name,)) if name.endswith(".weight")}
    return types | fused_expert_types(info, plans)


def fused_expert_types(info, plans) -> dict[str, str]:
    """The plan's entries of experts stored fused across experts (quantkit.arch.moe.fused_expert_linears): each
    expert's projection the type of the GGUF expert tensor written from it (`blk.N.ffn_gate_exps` for gate_proj)."""
    from quantkit.arch.moe import fused_expert_linears

    linears = fused_expert_linears(info.config, info.tensors)
    sources = {tensor for tensor, _shape in linears.values()}
    written: dict[str, list] = {}
    for plan in plans:
        if plan.hf_name in sources and plan.name.endswith(".weight"):
            written.setdefault(plan.hf_name, []).append(plan)
    types = {}
    for name, (tensor, _shape) in linears.items():
        stem, found = name.rsplit(".", 1)[1].removesuffix("_proj"), written.get(tensor, [])
        chosen = next((p for p in found if f".ffn_{stem}_exps." in p.name), found[0] if found else None)
        if chosen is not None:
            types[name] = f"gguf {chosen.qtype.name}"
    return types


def check(info, options: Options, calibration=None) -> None:
    """Architecture and its features supported (from config.json and the tensor names), a tokenizer
    llama.cpp reads as transformers does (quantkit.gguf.vocab.check_vocab), type known (validated in
    Options), imatrix file present and made for this model."""
    from quantkit.gguf.convert import check_convertible
    from quantkit.gguf.vocab import check_vocab

    spec = check_convertible(info.config, info.tensors)
    if measures(options):
        from quantkit.mixed.sensitivity import check_streamable

        check_streamable(info.path, "auto_precision.measure_windows: 0")
    if spec.vocab_check is not None:
        from quantkit.gguf.convert import load_hparams

        spec.vocab_check(info.path, load_hparams(info.path))
    check_vocab(info.path, spec.vocab)
    if info.towers.components and options.mmproj != "none":
        check_mmproj(info, options.mmproj)
    if options.imatrix not in ("auto", "none") and not Path(options.imatrix).is_file():
        raise InputError(f"imatrix file not found: {options.imatrix}",
                         hint='pass a llama.cpp imatrix (.gguf or .dat), "auto" or "none"')
    if options.imatrix not in ("auto", "none") and uses_imatrix(options):
        from quantkit.gguf import imatrix as im

        loaded = im.read(Path(options.imatrix))
        im.check_fits(loaded, info, options.gguf_type, Path(options.imatrix))
        check_mix(info, options, set(loaded.sums))
    else:
        check_mix(info, options)
    if mixed(options):
        check_sizes(info, options)


def check_sizes(info, options: Options) -> None:
    """Before any work: an auto_precision budget the cheapest types cannot meet, or an absolute
    fallback max_size below the first artifact's tensors, is BudgetError (exit 2) with the numbers."""
    from quantkit.mixed.budget import check_budget, check_max_size

    plans = model_plans(info, options.gguf_type, uses_imatrix(options))
    sizes = budget_sizes(options.auto_precision, plans, uses_imatrix(options))
    if options.auto_precision is not None:
        check_budget(sizes.cheapest, sizes.allowed, "gguf auto_precision",
                     f"the cheapest types take {8 * (sizes.cheapest + sizes.fixed) / sizes.weights:.3f} bits per "
                     "weight; raise budget_bpw")
    check_max_size(options.fallback, sizes.fixed + (sizes.allowed if options.auto_precision else sizes.mixture),
                   "gguf fallback")


def check_mmproj(info, mmproj_type: str) -> None:
    """A VLM's mmproj converts: its family has a conversion, the converter's features are the
    checkpoint's, every tower tensor has a GGUF name, and the image processor config gives
    image_mean / image_std (the mmproj metadata needs them)."""
    from quantkit.gguf import mmproj

    if info.towers.family is None:
        raise UnsupportedError(f"gguf: {info.architecture} has towers found by look ({', '.join(info.towers.unknown)}) "
                               "and no mmproj conversion",
                               hint="set the gguf option mmproj: none to write the language model alone "
                                    "(no image input)")
    planned = mmproj.plan(info.path, mmproj_type)
    if planned.converter == mmproj.MODERN:
        mmproj.need_stats(mmproj.image_stats(info.path), mmproj.FAMILIES[planned.family])


def cpu_threads() -> int:
    """The cores this process may use (llama-quantize's default is all of them too)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def model_name(job) -> str:
    return Path(job.info.path).name or "model"


def load_imatrix(job):
    """(Imatrix or None, how it was obtained)."""
    from quantkit.gguf import imatrix as im

    opts = job.options
    if not uses_imatrix(opts):
        return None, "none"
    if not computes_imatrix(opts):
        return im.read(Path(opts.imatrix)), f"file:{opts.imatrix}"
    calib = job.windows.calib
    source = f"computed ({len(calib)} x {calib.shape[1]} tokens)"
    saved = saved_imatrix(job)
    if saved.is_file():
        job.progress("imatrix: read from the saved progress" if job.resume_dir is not None else
                     "imatrix: computed by an earlier target of this run (same model and windows)")
        return im.read(saved), source
    job.progress(f"imatrix: {len(calib)} calibration windows through the model")
    imatrix = compute_imatrix(job, calib)
    save_imatrix(imatrix, saved)
    return imatrix, source


def saved_imatrix(job: QuantizeJob) -> Path:
    """Where the computed imatrix is kept: with --resume in the saved progress, so a resumed run reads it; else in
    the run's work directory, so the run's other GGUF targets (a recipe's types, --method auto's candidates) read
    it instead of computing it again (one model and one set of calibration windows per run)."""
    return Path(job.resume_dir if job.resume_dir is not None else job.workdir) / "imatrix.gguf"


def save_imatrix(imatrix, path: Path) -> None:
    """Written whole and fsynced under a temporary name, then renamed into place."""
    import os

    from quantkit.gguf import imatrix as im

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    im.write(imatrix, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def compute_imatrix(job: QuantizeJob, calib):
    """The imatrix of the full-precision checkpoint on the calibration windows. A text decoder is read
    whole where the run's placement has room for it, else streamed a layer at a time (all windows through
    one layer, then the next), so memory stays at one layer's weights (quantkit.eval.resident.forward_model);
    other models (a VLM's language part) are loaded whole, or `job.model` is used where the method has it
    loaded."""
    from quantkit.engines.transformers import device_map, hf_config, load_model, torch_dtype
    from quantkit.eval.resident import forward_model
    from quantkit.eval.stream import StreamedModel, streamable, windows_per_group
    from quantkit.gguf import imatrix as im
    from quantkit.io.checkpoint import SafetensorsWeights

    if not streamable(job.info.config):
        model = job.model if job.model is not None else load_model(job.info, job.dtype, job.device,
                                                                    job.trust_remote_code)
        return im.compute(model, calib, job.info.config, dataset=job.windows.source)
    config = hf_config(job.info.path, job.trust_remote_code)  # config.json only
    forward = forward_model(config, SafetensorsWeights(job.info.path), torch_dtype(job.dtype, job.info),
                            device_map(job.device), job.placement.room)
    job.progress("imatrix: the model " + ("streamed a layer at a time" if isinstance(forward, StreamedModel)
                                          else "whole in memory"))
    group = windows_per_group(config.get_text_config(), calib.shape[1])
    return im.compute(forward.model, calib, job.info.config, dataset=job.windows.source, batch_size=group,
                      device=forward.device)


def needs_calibration(options: Options) -> bool:
    """Windows for the imatrix, and for the sensitivity pass of auto_precision / fallback."""
    return computes_imatrix(options) or mixed(options)


def importance(job: QuantizeJob, imatrix):
    """The imatrix weighting the sensitivity errors: the quantizer's own, else one computed from
    the calibration windows (kept in the work dir for the fallback's later steps)."""
    from quantkit.gguf import imatrix as im

    if imatrix is not None:
        return imatrix
    path = Path(job.workdir) / "importance.gguf"
    if path.is_file():
        return im.read(path)
    computed = compute_imatrix(job, job.windows.calib)
    im.write(computed, path)
    return computed


def plans_of(job: QuantizeJob, has_imatrix: bool):
    return model_plans(job.info, job.options.gguf_type, has_imatrix)


def model_plans(info, gguf_type: str, has_imatrix: bool):
    """Every tensor the converter writes for this model, with the mixture's type (quantkit.gguf.convert)."""
    from quantkit.gguf.convert import load_hparams, plan_tensors

    hp = {**load_hparams(info.path), "architectures": info.config.get("architectures")}
    return plan_tensors(hp, info.tensors, gguf_type, has_imatrix=has_imatrix, model_dir=info.path)


def sensitivity_table(job: QuantizeJob, plans, imatrix, auto: AutoPrecision):
    """quantkit.mixed.gguf.measure for this job's checkpoint and calibration windows."""
    from quantkit.mixed import gguf as sensitivity

    weights = imatrix.weights() if imatrix is not None else None
    return sensitivity.measure(job.info.path, plans, weights, importance(job, imatrix).weights(), job.windows.calib,
                               measure_windows(job, auto), cpu_threads(), Path(job.workdir), auto.probes_per_role,
                               job.progress)


def measure_windows(job: QuantizeJob, auto: AutoPrecision) -> int:
    """The most calibration windows the sensitivity pass measures on: measure_windows, and no more than the
    gate holds out (quantkit.mixed.sensitivity.probe_windows bounds them by the calibration too)."""
    return min(auto.measure_windows, max(1, len(job.windows.eval)))


@dataclass(frozen=True)
class BudgetSizes:
    """Tensor bytes in the file (quantkit.mixed.gguf.nbytes) of the tensors a budget may retype
    (every quantized one with a candidate type) and of the rest."""

    allowed: int  # what the budgeted tensors may take: budget_bpw's share, or the mixture's
    mixture: int  # what llama.cpp's mixture gives them
    cheapest: int  # their cheapest candidate types
    fixed: int  # every other tensor (norms, 16-bit tensors)
    weights: int  # values in all tensors


def budget_sizes(auto: AutoPrecision | None, plans, has_imatrix: bool) -> BudgetSizes:
    from quantkit.mixed.gguf import nbytes, plan_candidates, quantized_plans

    budgeted = {p.name for p in quantized_plans(plans)}
    mixture = sum(nbytes(p.shape, p.qtype) for p in plans if p.name in budgeted)
    cheapest = sum(nbytes(p.shape, plan_candidates(p, has_imatrix)[0]) for p in plans if p.name in budgeted)
    fixed = sum(nbytes(p.shape, p.qtype) for p in plans if p.name not in budgeted)
    weights = sum(math.prod(p.shape) for p in plans)
    allowed = mixture if auto is None or auto.budget_bpw is None else int(auto.budget_bpw * weights / 8) - fixed
    return BudgetSizes(allowed, mixture, cheapest, fixed, weights)


def write_gguf(job: QuantizeJob, imatrix, types: dict | None, details: dict) -> QuantizeResult:
    """Convert with the mixture (types None) or per-tensor types; the Modelfile, and for per-tensor
    types the llama-quantize --tensor-type-file that reproduces them."""
    from quantkit.gguf.convert import convert
    from quantkit.gguf.modelfile import read_chat_template, render
    from quantkit.mixed.gguf import override_lines

    opts = job.options
    name = model_name(job)
    out_path = Path(job.out_dir) / f"{name}-{opts.gguf_type}.gguf"
    job.progress(f"writing {out_path.name}")
    result = convert(job.info.path, out_path, opts.gguf_type,
                     imatrix=imatrix.weights() if imatrix is not None else None, name=name, threads=cpu_threads(),
                     types=types, progress=job.progress, state=conversion_state(job, out_path))
    for warning in result.vocab.get("warnings", []):
        job.progress(f"warning: {warning}")
    projector = write_mmproj(job, name)
    (Path(job.out_dir) / "Modelfile").write_text(render(out_path.name, read_chat_template(job.info.path),
                                                        projector.get("file")))
    gguf = {**details.get("gguf", {}), "file": out_path.name, "type": opts.gguf_type,
            "tensor_types": result.type_counts, "tensors": result.tensors, "bytes": result.bytes,
            "imatrix_tensors": result.imatrix_tensors, "vocab": result.vocab}
    if projector:
        gguf["mmproj"] = projector
    if types:
        (Path(job.out_dir) / TENSOR_TYPES_FILE).write_text("\n".join(override_lines(types)) + "\n")
        gguf["tensor_types_file"] = TENSOR_TYPES_FILE
    return QuantizeResult(out_path, {**details, "gguf": gguf})


def conversion_state(job: QuantizeJob, out_path: Path) -> Path | None:
    """--resume: the file recording each tensor written to out_path (quantkit.gguf.resume); None without."""
    if job.resume_dir is None:
        return None
    Path(job.resume_dir).mkdir(parents=True, exist_ok=True)
    return Path(job.resume_dir) / f"{out_path.name}.json"


def resume_bytes(info, options: Options, calibration=None) -> int:
    """Disk the saved progress takes beyond the .gguf itself: the computed imatrix (a float32 per input
    column of every matrix, twice while it is replaced) and the state file (~200 bytes per tensor)."""
    matrices = [shape for _dtype, shape in info.tensors.values() if len(shape) >= 2]
    imatrix = 2 * sum(4 * shape[-1] for shape in matrices) if computes_imatrix(options) else 0
    return imatrix + 2 * 200 * len(info.tensors)


def write_mmproj(job: QuantizeJob, name: str) -> dict:
    """A VLM's mmproj file beside the language model (what quantkit.json reports about it); {} for
    a text model; for mmproj: none, the report says the language model was written alone."""
    from quantkit.gguf import mmproj

    opts = job.options
    if not job.info.towers.components:
        return {}
    if opts.mmproj == "none":
        return {"file": None, "written": False,
                "reason": "mmproj: none: the language model alone, without its vision tower (no image input)"}
    planned = mmproj.plan(job.info.path, opts.mmproj)
    path = Path(job.out_dir) / f"mmproj-{name}-{planned.outtype.name}.gguf"
    result = mmproj.write(planned, job.info.path, path)
    return {"file": path.name, "written": True, "requested": opts.mmproj, "type": result.file_type,
            "converter": f"llama.cpp {result.converter}", "family": result.family,
            "tensor_types": result.type_counts, "tensors": result.tensors, "bytes": result.bytes}


def quantize(job: QuantizeJob) -> QuantizeResult:
    import time

    from quantkit.gguf import imatrix as im
    from quantkit.mixed import gguf as budget

    opts = job.options
    imatrix, source = load_imatrix(job)
    if imatrix is not None and source.startswith("computed"):
        im.write(imatrix, Path(job.workdir) / "imatrix.gguf")
    details: dict = {"gguf": {"imatrix": source}}
    if opts.auto_precision is None:
        return write_gguf(job, imatrix, None, details)
    started = time.perf_counter()
    plans = plans_of(job, imatrix is not None)
    table = sensitivity_table(job, plans, imatrix, opts.auto_precision)
    sizes = budget_sizes(opts.auto_precision, plans, imatrix is not None)
    types, check = measured_choice(job, plans, imatrix, table, budget.assign_types(table.tensors, sizes.allowed), sizes)
    table.seconds["total"] = round(time.perf_counter() - started, 3)
    details["sensitivity"] = table.as_dict()
    details["mixed_precision"] = {**mixed_report(table.tensors, types, sizes, sizes.allowed), **check}
    job.progress(f"auto-precision: {len(details['mixed_precision']['changed'])} of {len(types)} tensors differ "
                 f"from the {opts.gguf_type} mixture; {details['mixed_precision']['bytes']:,} of "
                 f"{sizes.allowed:,} budgeted bytes")
    return write_gguf(job, imatrix, types, details)


def measured_choice(job: QuantizeJob, plans, imatrix, sensitivity, types: dict, sizes: BudgetSizes
                    ) -> tuple[dict, dict]:
    """The per-tensor types to write, chosen by measurement among the search's, a second search's with the
    embedding and head kept at the mixture's types or above, and llama.cpp's mixture where it fits the
    budget: each map applied whole, its KL divergence measured on the windows the probes used. The damage
    model sums per-tensor estimates, and at the 2-bit types it can rank maps wrongly. The second value is
    details.mixed_precision.measured ({} where nothing was measured)."""
    from quantkit.mixed import gguf as budget

    table = sensitivity.tensors
    maps = {"search": types, "search, head kept": budget.assign_types(budget.head_kept(table), sizes.allowed)}
    if sizes.mixture <= sizes.allowed:
        maps["mixture"] = budget.mixture_types(table)
    distinct: dict[str, dict] = {}
    for label, candidate in maps.items():
        if candidate not in distinct.values():
            distinct[label] = candidate
    if not sensitivity.measured or len(distinct) == 1:
        return types, {}
    windows = job.windows.calib[:sensitivity.windows]
    job.progress(f"auto-precision: {', '.join(distinct)} measured whole on {len(windows)} windows")
    klds = budget.measure_type_maps(job.info.path, plans, distinct, imatrix.weights() if imatrix is not None else None,
                                    windows, Path(job.workdir), job.progress, cpu_threads())
    kept = min(klds, key=klds.get)  # a tie keeps the earlier map (search first)
    return distinct[kept], {"measured": {"windows": len(windows), "kld": {k: round(v, 8) for k, v in klds.items()},
                                         "kept": kept}}


def mixed_report(table, types: dict, sizes: BudgetSizes, budget: int | None) -> dict:
    """details.mixed_precision: the bytes of the budgeted tensors (and their budget, checked: InternalError
    if the types broke it), every tensor's type and the ones that differ from the mixture."""
    from quantkit.errors import InternalError
    from quantkit.mixed.gguf import total_bytes

    used = total_bytes(table, types)
    if budget is not None and used > budget:
        raise InternalError(f"gguf: the per-tensor types take {used:,} bytes, over the budget of {budget:,}")
    limit = {} if budget is None else {"budget_bytes": budget}
    return {**limit, "mixture_bytes": sizes.mixture, "cheapest_bytes": sizes.cheapest, "bytes": used, "types": {name: t.name for name, t in sorted(types.items())},
            "changed": {t.name: f"{t.plain}->{types[t.name].name}" for t in table if types[t.name].name != t.plain}}


def fallback_ladder(job: QuantizeJob, result: QuantizeResult):
    """What the gate-driven fallback raises: every budgeted tensor, from its type in the artifact (the
    mixture's, or auto_precision's) through its candidate types (quantkit.mixed.budget.Ladder)."""
    from quantkit.mixed import gguf as budget
    from quantkit.mixed.budget import Ladder
    from quantkit.mixed.gguf import Sensitivity

    if "sensitivity" in result.details:
        table = Sensitivity.from_dict(result.details["sensitivity"])
    else:
        imatrix = current_imatrix(job)
        table = sensitivity_table(job, plans_of(job, imatrix is not None), imatrix,
                                  job.options.auto_precision or AutoPrecision())
    plan = result.details.get("mixed_precision", {}).get("types") or {t.name: t.plain for t in table.tensors}
    return Ladder(table.tensors, dict(plan), budget.tensor_size, details={"sensitivity": table.as_dict()})


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """The .gguf written again with per-tensor types `plan` ({tensor: type name})."""
    from quantkit.gguf.mixture import T
    from quantkit.mixed.gguf import Sensitivity

    imatrix = current_imatrix(job)
    sizes = budget_sizes(job.options.auto_precision, plans_of(job, imatrix is not None), imatrix is not None)
    table = Sensitivity.from_dict(details["sensitivity"]).tensors
    types = {name: T[t] for name, t in plan.items()}
    return write_gguf(job, imatrix, types, {**details, "mixed_precision": mixed_report(table, types, sizes, None)})


def current_imatrix(job: QuantizeJob):
    """The imatrix the first artifact was quantized with (computed once into the work dir)."""
    from quantkit.gguf import imatrix as im

    if computes_imatrix(job.options):
        return im.read(Path(job.workdir) / "imatrix.gguf")
    return load_imatrix(job)[0]


def stored_bits(options: Options) -> float:
    """The base type's bits per weight, with a margin for the mixture's larger parts (Q4_K_M: Q6_K)."""
    return type_bits(options.gguf_type) * MIX_MARGIN


def type_bits(gguf_type: str) -> float:
    """Bits per weight of a file type's base ggml type (Q4_K_M: Q4_K, 4.5)."""
    from quantkit.gguf.mixture import FILE_TYPES

    return ggml_bits(FILE_TYPES[gguf_type][1])


def precision_bits(options: Options, precision: str) -> float:
    """Bits per weight of a plan entry's ggml type ("gguf Q6_K": 6.5625; the default a plan falls back to
    where the mixture cannot be planned, "gguf Q4_K (Q4_K_M mix)": Q4_K's)."""
    from gguf import GGMLQuantizationType

    return ggml_bits(GGMLQuantizationType[precision.removeprefix("gguf ").split(" ")[0]])


def ggml_bits(qtype) -> float:
    """Bits per weight of a ggml type, block scales included (gguf-py's GGML_QUANT_SIZES)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def support(family) -> str:
    """A text family converts when llama.cpp's converter has its architecture; a VLM also needs an
    mmproj conversion for its towers (`mmproj: none` is the opt-in language-model-only output)."""
    from quantkit.gguf import mmproj
    from quantkit.gguf.convert import REFUSED, ROUTED_BY_TEXT_CONFIG, supported_architectures

    converts = family.architecture in supported_architectures()
    if family.architecture in REFUSED:
        return f"refused: {REFUSED[family.architecture]}"
    if not family.is_vlm:
        return "✅" if converts else "refused: the converter lacks this architecture"
    if not (converts or family.architecture in ROUTED_BY_TEXT_CONFIG):
        return "refused: llama.cpp's convert_hf_to_gguf.py has no conversion for its architecture"
    if family.model_type not in mmproj.FAMILIES:
        return "refused: no mmproj conversion (`mmproj: none` writes the language model alone)"
    projector = mmproj.FAMILIES[family.model_type]
    note = f" ({projector.note})" if projector.note else ""
    return f"✅ language model + mmproj, as llama.cpp's {projector.converter}{note}"


def tower_proof(job: QuantizeJob, result: QuantizeResult) -> dict:
    """A VLM's towers are its mmproj file's: bit-identical to the source and an image+text forward
    (quantkit.eval.vlm_proof.prove_mmproj); none to prove when `mmproj: none` was asked for."""
    from quantkit.eval.vlm_proof import prove_mmproj

    projector = result.details.get("gguf", {}).get("mmproj") or {}
    if not projector.get("file"):
        return {"tower_tensors_identical": 0, "mmproj": None,
                "image_forward": "skipped: mmproj: none, the .gguf holds the language model only"}
    return prove_mmproj(result.artifact.parent / projector["file"], job.info, job.options.mmproj)


# why a torchrun launch is refused: nothing of the work is split between ranks
RANKS_REFUSED = ("quantkit's GGUF conversion writes the file tensor by tensor in one process, its imatrix from one "
                 "process's streamed forward")


ROTATION_REFUSED = ("a GGUF file stores no transform and llama.cpp applies none, and quantkit's GGUF conversion "
                    "does not run llm-compressor's transform modifiers")


# --method auto (quantkit.run.auto): the k-quant and i-quant mixtures people publish, small to large (the legacy
# Q4_0/Q5_0 types are no smaller than the k-quants beside them)
AUTO_TYPES = ("IQ2_M", "Q2_K", "IQ3_XXS", "IQ3_S", "IQ3_M", "Q3_K_M", "Q3_K_L", "IQ4_XS", "Q4_K_S", "Q4_K_M", "Q5_K_S",
              "Q5_K_M", "Q6_K", "Q8_0")
AUTO_RUNGS = tuple(AutoRung(f"gguf {t}", (("gguf_type", t),), "gguf") for t in AUTO_TYPES)

METHOD = MethodSpec(
    name="gguf", format=gguf_format.FORMAT, label="GGUF (llama.cpp / Ollama)", scheme=lambda options: options.gguf_type,
    engine="quantkit-gguf", engine_package="quantkit", options=Options, quantize=quantize, precision=precision,
    default_gate=default_gate, check=check, needs_calibration=needs_calibration,
    needs_model=lambda info, options: False,  # conversion reads the checkpoint; the imatrix streams it
    support=support, rotation_refused=ROTATION_REFUSED,
    layers=Layers(
        keeps_lm_head=lambda options: False,  # the mixture gives output.weight its own type (Q6_K for most mixes)
        takes_ignore=False,  # per-tensor types come from llama-quantize's mixture rules
        exact_types=plan_types, quantizes_fused_experts=lambda info, options: True),  # as stacked expert tensors
    sizes=Sizes(stored_bits=stored_bits, precision_bits=precision_bits),
    fallback=FallbackSteps(fallback_ladder, requantize),
    resume=Resume("the last written tensor", bytes=resume_bytes),
    ranks=OnRanks(lambda options: RANKS_REFUSED),  # converts in one process: refused on ranks, saying why
    towers=Towers(proof=tower_proof),
    auto=AUTO_RUNGS,
)
