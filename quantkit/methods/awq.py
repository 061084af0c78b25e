"""AWQ (activation-aware weight quantization) W4A16 asymmetric through llm-compressor.

AWQModifier searches per-channel scales between each smooth layer and the linears it feeds
(mappings per architecture in `awq_mappings`), then QuantizationModifier rounds the scaled
weights to int4 with a zero point per group. Output: compressed-tensors `pack-quantized`
with `weight_zero_point`, served by vLLM (Marlin).

backend "autoawq" (the archived AutoAWQ package, GEMM format) is accepted as an option so
recipes can name it, but it is refused before any work with a clear reason: not installed
(MissingExtraError), or installed but its GEMM checkpoint cannot be reloaded by transformers 5
without `gptqmodel`, so the gate could not measure it (see docs/methods.md).

CPU workaround: llm-compressor 0.14.0.1 pins the cached parent-module inputs in host memory
before AWQ's grid search (`IntermediatesCache.pin_memory`, called from
`AWQModifier._apply_smoothing`); `Tensor.pin_memory()` raises "Cannot access accelerator
device when none is available" on a machine without an accelerator. `cpu_pin_memory_guard`
turns exactly that method into a no-op while AWQ runs, and only when no accelerator exists
(pinning only speeds up host-to-device copies, which never happen then).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict

from quantkit.errors import InputError, MissingExtraError, UnsupportedError
from quantkit.methods import MethodSpec, QuantizeJob, QuantizeResult, fixed_gate, gptq, llmc
from quantkit.methods.mappings import model_mappings

# 4-bit weights: the same looser gate as GPTQ.
DEFAULT_GATE = {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80}

# Where llm-compressor pins memory (module, class, method): checked by the test suite.
PIN_MEMORY_SITE = ("llmcompressor.pipelines.cache", "IntermediatesCache", "pin_memory")


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    duo_scaling: bool | Literal["both"] = True
    n_grid: int = 20
    backend: Literal["llmcompressor", "autoawq"] = "llmcompressor"


def needs_calibration(options: Options) -> bool:
    return True


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in gptq.QUANTIZED_ROLES:
        return None
    sym = "sym" if options.symmetric else "asym"
    return f"int{options.bits} {gptq.granularity(options.group_size)} {sym} (AWQ)"


def check_backend(backend: str) -> None:
    """autoawq: say honestly why it cannot be used here (missing, or its output cannot be gated)."""
    if backend != "autoawq":
        return
    import importlib.util

    if importlib.util.find_spec("awq") is None:
        raise MissingExtraError("autoawq", "autoawq", "awq backend 'autoawq'")
    if importlib.util.find_spec("gptqmodel") is None:
        raise UnsupportedError(
            "awq backend 'autoawq' cannot be gated here: transformers 5 loads AutoAWQ GEMM checkpoints only "
            "through the 'gptqmodel' package, which is not installed, so the artifact could not be reloaded "
            "and measured",
            hint="use the default backend 'llmcompressor' (compressed-tensors, served by vLLM)",
        )
    raise UnsupportedError(
        "awq backend 'autoawq' is not implemented in this version of quantkit (AutoAWQ 0.2.9 is archived)",
        hint="use the default backend 'llmcompressor' (compressed-tensors, served by vLLM)",
    )


def check(info, options: Options, calibration) -> None:
    check_backend(options.backend)
    model_mappings(info, "awq")
    gptq.check_moe(info, options.symmetric, "none", "awq")
    gptq.check_bits(options.bits, "awq")
    gptq.check_group_size(info, options.group_size, "awq")
    if options.n_grid < 1:
        raise InputError(f"awq: n_grid={options.n_grid} must be positive")
    gptq.check_calibration_tokens(calibration, "awq")


# ---------------------------------------------------------------- the CPU workaround


def pin_memory_target():
    """The class whose pin_memory AWQ calls (raises if an upgrade moved or renamed it)."""
    import importlib

    module_name, class_name, method = PIN_MEMORY_SITE
    cls = getattr(importlib.import_module(module_name), class_name)
    if not callable(getattr(cls, method, None)):
        raise AttributeError(f"{module_name}.{class_name}.{method} no longer exists")
    return cls


@contextmanager
def cpu_pin_memory_guard() -> Iterator[bool]:
    """No-op `IntermediatesCache.pin_memory` while inside, only without an accelerator.

    Yields whether the patch is active. The original method is restored on exit.
    """
    import torch

    if torch.accelerator.is_available():
        yield False
        return
    cls = pin_memory_target()
    method = PIN_MEMORY_SITE[2]
    original = cls.__dict__[method]
    setattr(cls, method, lambda self, *args, **kwargs: None)
    try:
        yield True
    finally:
        setattr(cls, method, original)


# ---------------------------------------------------------------- quantize


def mappings(info) -> list:
    """llm-compressor's AWQ mappings: the table's AWQ rows for this model (quantkit.methods.mappings)."""
    from llmcompressor.modifiers.transform.awq import AWQMapping

    return [AWQMapping(m.smooth, list(m.balance)) for m in model_mappings(info, "awq") if m.awq]


def modifiers(options: Options, info, ignore: list[str]) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = gptq.weight_args(options.bits, options.group_size, options.symmetric)
    return [
        AWQModifier(mappings=mappings(info), duo_scaling=options.duo_scaling,
                    n_grid=options.n_grid),
        QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=ignore),
    ]


def quantize(job: QuantizeJob) -> QuantizeResult:
    recipe = modifiers(job.options, job.info, llmc.decoder_ignore(job))
    details = llmc.calibration_details(job)
    with cpu_pin_memory_guard() as patched:
        llmc.run_oneshot(job, recipe, calibrate=True)
    llmc.save_compressed(job)
    return QuantizeResult(job.out_dir, {**details, "cpu_pin_memory_workaround": patched})


METHOD = MethodSpec(
    quantizes_towers=True, name="awq", engine=llmc.ENGINE, engine_package=llmc.ENGINE,
    format="compressed-tensors (pack-quantized, int4 asymmetric)",
    options=Options, quantize=quantize, precision=precision, default_gate=fixed_gate(DEFAULT_GATE),
    check=check, needs_calibration=needs_calibration,
)
