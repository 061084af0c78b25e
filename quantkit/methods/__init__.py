"""Method plugins, looked up through a static name -> module map and imported lazily.

Each method module defines, light enough to import without torch:
  - `Options`: a pydantic model (extra="forbid") of the method's recipe options;
  - `ENGINE`: the library that does the work (for reports);
  - `FORMAT`: the artifact format it writes;
  - `DEFAULT_GATE`: per-method default gate thresholds (dict), or `default_gate(options)` where
    they depend on the options (GGUF: Q8_0 is held tighter than Q2_K);
and, importing heavy libraries inside the function:
  - `quantize(job: QuantizeJob) -> None`: quantize `job.model` and save the artifact into
    `job.out_dir` (a staging directory); `job` is quantkit.pipeline.QuantizeJob.
  - `precision(role, options, name, shape) -> str | None`: the precision a linear weight of
    that role gets (None: kept in the model's 16-bit dtype); used by the plan;
  - optionally `check(info, options, spec) -> None`: cheap checks before long work starts.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from quantkit.errors import InputError

METHODS: dict[str, str] = {
    "fp8": "quantkit.methods.fp8",
    "gptq": "quantkit.methods.gptq",
    "awq": "quantkit.methods.awq",
    "smoothquant": "quantkit.methods.smoothquant",
    "nf4": "quantkit.methods.nf4",
    "gguf": "quantkit.methods.gguf",
}


def check_method_name(name: str) -> str:
    if name not in METHODS:
        raise InputError(
            f"unknown method '{name}'",
            hint="choose one of: " + ", ".join(METHODS),
        )
    return name


def get_method(name: str) -> ModuleType:
    """The method's module; a method whose module is not written yet fails loudly."""
    check_method_name(name)
    try:
        return importlib.import_module(METHODS[name])
    except ModuleNotFoundError as exc:
        if exc.name == METHODS[name]:
            raise InputError(f"method '{name}' is not available in this version of quantkit") from exc
        raise
