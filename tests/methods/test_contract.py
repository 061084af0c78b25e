"""Every method module declares the full contract of quantkit.methods.MethodSpec."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import fields

import pytest
from pydantic import BaseModel

from quantkit.formats import Format, Runtime
from quantkit.methods import (
    METHODS,
    AutoRung,
    FallbackSteps,
    Layers,
    MethodSpec,
    OnRanks,
    Resume,
    Sizes,
    Towers,
    get_method,
    runtimes_for,
)
from quantkit.run.recipe import Calibration, Gate


@pytest.mark.parametrize("name", list(METHODS))
def test_method_declares_the_contract(name):
    spec = get_method(name)
    assert isinstance(spec, MethodSpec) and spec.name == name
    assert issubclass(spec.options, BaseModel) and spec.options.model_config.get("extra") == "forbid"
    options = spec.options()  # every option has a default
    records = {"layers": Layers, "sizes": Sizes, "fallback": FallbackSteps, "resume": Resume, "ranks": OnRanks,
               "towers": Towers}
    for member in fields(MethodSpec):
        value = getattr(spec, member.name)
        if member.name in ("name", "engine", "label", "rotation_refused"):
            assert isinstance(value, str) and value, member.name
        elif member.name == "engine_package":
            assert isinstance(value, str) and isinstance(spec.package, str) and spec.package
        elif member.name == "format":
            assert isinstance(value, Format)
        elif member.name in records:  # a record, or None where the method has none of it
            assert value is None or isinstance(value, records[member.name]), member.name
        elif member.name == "auto":  # --method auto's rungs: options the method's own model takes
            assert value and all(isinstance(rung, AutoRung) and rung.label for rung in value)
            for rung in value:
                spec.options.model_validate(dict(rung.options))
        elif member.name != "options":
            assert callable(value), member.name
    # exactly the methods with a `fallback` option have the fallback's steps
    assert (spec.fallback is not None) == ("fallback" in spec.options.model_fields)
    assert spec.resume is None or (isinstance(spec.resume.unit, str) and spec.resume.unit)
    assert spec.layers is not None and spec.sizes is not None and spec.towers is not None
    assert isinstance(spec.layers.takes_ignore, bool) and isinstance(spec.towers.quantizes, bool)
    assert isinstance(spec.layers.keeps_lm_head(options), bool)
    assert spec.sizes.stored_bits(options) > 0
    assert spec.format.kind in ("compressed-tensors", "bitsandbytes", "gguf", "mlx")
    runtimes = runtimes_for(spec, options)
    assert runtimes and all(isinstance(r, Runtime) and r.source for r in runtimes)
    assert spec.format.serve_command("OUT").split()[0] in ("vllm", "llama-server", "mlx_lm.generate")
    assert isinstance(spec.needs_calibration(options), bool)
    Gate(**spec.default_gate(options))  # thresholds are Gate fields
    assert spec.precision("decoder", options, "model.layers.0.mlp.up_proj", [256, 256])
    assert spec.precision("vision", options, "model.vision_tower.x", [256, 256]) is None or name == "gguf"
    assert list(inspect.signature(spec.check).parameters) == ["info", "options", "calibration"]
    assert list(inspect.signature(spec.quantize).parameters) == ["job"]
    from quantkit.arch.families import text_rows, vlm_rows

    for family in text_rows() + vlm_rows():
        verdict = spec.support(family)
        assert verdict.startswith(("✅", "refused: ")), (family.name, verdict)


@pytest.mark.parametrize("name", list(METHODS))
def test_method_modules_import_without_torch(name):
    code = (f"import sys, json; from quantkit.methods import get_method; get_method({name!r}); "
            "print(json.dumps([m for m in ('torch', 'transformers', 'llmcompressor') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_calibration_needs_are_declared():
    assert get_method("fp8").needs_calibration(get_method("fp8").options(scheme="fp8-static"))
    assert not get_method("fp8").needs_calibration(get_method("fp8").options())
    assert not get_method("nf4").needs_calibration(get_method("nf4").options())
    gguf = get_method("gguf")
    assert gguf.needs_calibration(gguf.options(gguf_type="Q4_K_M"))
    assert not gguf.needs_calibration(gguf.options(gguf_type="Q8_0"))
    for name in ("gptq", "awq", "smoothquant"):
        assert get_method(name).needs_calibration(get_method(name).options())
    nvfp4 = get_method("nvfp4")
    assert nvfp4.needs_calibration(nvfp4.options()) and not nvfp4.needs_calibration(nvfp4.options(scheme="a16"))
    assert nvfp4.needs_calibration(nvfp4.options(scheme="a16", kv_cache="fp8"))
    Calibration(num_samples=0)  # allowed: methods that need windows refuse it in the pipeline


def test_no_hidden_module_state_in_the_package():
    """No function in quantkit/ keeps state between calls: no `global` rebinding, no memoizing caches."""
    from pathlib import Path

    import quantkit

    offenders = []
    for path in Path(quantkit.__file__).parent.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("global ") or "lru_cache" in line or "functools.cache" in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == []


def test_stored_bits_per_method():
    from quantkit.methods import awq, get_method, gguf, gptq, nf4

    def bits(name, options):
        return get_method(name).sizes.stored_bits(options)

    assert bits("fp8", None) == 8.0 and bits("smoothquant", None) == 8.0
    assert bits("gptq", gptq.Options(bits=4, group_size=128)) == 4.25
    assert bits("awq", awq.Options(group_size=-1)) == 4
    assert bits("nf4", nf4.Options()) < 4.2 and bits("nf4", nf4.Options(scheme="int8")) == 8
    assert gguf.type_bits("Q8_0") == 8.5 and gguf.type_bits("Q4_K_M") == 4.5
    assert bits("gguf", gguf.Options(gguf_type="Q4_K_M")) > 4.5
    assert bits("nvfp4", None) == 4.5  # fp4 values and an fp8 scale per 16
    assert bits("mxfp4", None) == 4.25  # fp4 values and an e8m0 scale per 32


def test_the_end_of_a_step_hands_memory_back_with_or_without_a_model(monkeypatch):
    """ModelHandle.free after every quantize step: cycles collected and the heap trimmed even where no model
    was loaded (a method's own forwards: mlx, gguf), as where one was."""
    import gc

    from quantkit.io import memory
    from quantkit.methods import ModelHandle

    calls = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: calls.append("trim"))
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect"))
    ModelHandle().free()
    assert calls == ["collect", "trim"]
