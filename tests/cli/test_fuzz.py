"""Fuzzing recipes (hypothesis): whatever the YAML holds, `recipes validate` and `quantize --recipe`
answer with exit 0 or 2 and one error line, never an internal error (1) or a traceback."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from quantkit.methods import METHODS  # noqa: E402

FUZZ = settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                      HealthCheck.function_scoped_fixture])

OPTION_NAMES = ["scheme", "bits", "group_size", "act_order", "backend", "gguf_type", "imatrix", "mmproj", "smoothing_strength",
                "double_quant", "compute_dtype", "quantize_lm_head", "ignore"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["Q4_K_M", "Q8_0", "fp8-dynamic", "nf4", "auto", "none",
                                                           "re:(", "re:.*", "cpu", "cuda", "bfloat16", "0", "-1"]))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=8)


def maybe(keys: list[str], value):
    """A mapping with some of `keys` (and sometimes a stray key), each holding `value` or anything."""
    return st.dictionaries(st.sampled_from([*keys, "stray"]), st.one_of(value, anything), max_size=len(keys))


options = maybe(OPTION_NAMES, scalars)
gate = maybe(["enabled", "max_ppl_increase", "max_kld", "min_top1"], st.floats(-1, 2))
target = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["a", "b", "q4", "bad name", ""]), anything),
    "method": st.one_of(st.sampled_from([*METHODS, "magic"]), anything),
    "options": st.one_of(options, anything), "ignore": st.one_of(st.lists(scalars, max_size=3), anything),
    "gate": st.one_of(gate, anything)})
calibration = maybe(["source", "num_samples", "seq_len", "seed", "chat_template", "text_field", "eval_windows"],
                    st.one_of(st.integers(-5, 10**6), st.sampled_from(["default", "code", "hf:x", "missing.txt"])))
recipes = st.one_of(
    st.fixed_dictionaries({}, optional={
        "targets": st.one_of(st.lists(target, max_size=3), anything), "calibration": st.one_of(calibration, anything),
        "gate": st.one_of(gate, anything), "model": anything, "lora": anything, "device": anything,
        "dtype": anything, "trust_remote_code": anything, "stray": anything}),
    anything)
texts = st.one_of(recipes.map(lambda d: yaml.safe_dump(d, allow_unicode=True)), st.text(max_size=80),
                  st.binary(max_size=40).map(lambda b: b.decode("latin-1")))


def check_answer(result):
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1, result.stderr


def recipe_file(directory: str, text: str) -> Path:
    path = Path(directory) / "recipe.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    return path


@FUZZ
@given(text=texts)
def test_recipes_validate_never_crashes(cli, text):
    with tempfile.TemporaryDirectory() as directory:
        check_answer(cli("recipes", "validate", recipe_file(directory, text)))


@FUZZ
@given(text=texts, flags=st.lists(st.sampled_from([
    ["--method", "fp8"], ["--bits", "4"], ["--gguf-type", "Q4_K_M"], ["--seq-len", "64"], ["--lora", "nowhere"],
    ["--ignore", "re:("], ["--max-kld", "0.1"], ["--device", "cuda"], ["--calib", "missing.txt"]]), max_size=2))
def test_quantize_recipe_never_crashes(cli, text, flags):
    """The model does not exist, so no run ever starts: the answer is about the recipe and flags."""
    with tempfile.TemporaryDirectory() as directory:
        path = recipe_file(directory, text)
        args = [arg for flag in flags for arg in flag]
        result = cli("quantize", "--recipe", path, "--model", Path(directory) / "no-model", *args,
                     "-o", Path(directory) / "out")
        check_answer(result)
        assert result.exit_code == 2
