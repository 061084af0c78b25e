"""docs/development.md's worked examples, tested: a method on an existing format (tests/plugins/toy_round.py) and a
new format with the method that writes it (tests/plugins/toy_int8.py) plug in through the entry points alone (a
dist-info directory on the path, as an installed package declares them), run through `quantkit quantize` on the
micro model, and the gate reads each artifact back (its format detected, its metrics measured)."""

from __future__ import annotations

import importlib
import json
import math

import pytest

CALIB = ("--num-samples", "8", "--seq-len", "128", "--eval-windows", "2", "--seed", "0")
ENTRY_POINTS = """\
[quantkit.methods]
toy-round = tests.plugins.toy_round:METHOD
toy-int8 = tests.plugins.toy_int8:METHOD

[quantkit.formats]
toy-int8 = tests.plugins.toy_int8:FORMAT
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """The toy package's entry points, installed on sys.path as a dist-info directory."""
    dist = tmp_path / "site" / "quantkit_toy_plugins-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: quantkit-toy-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return dist


def test_nothing_is_registered_without_the_entry_points():
    from quantkit import formats, methods

    assert "toy-round" not in methods.registered() and "toy-int8" not in formats.registered()


def test_the_registries_list_the_plugins(plugins):
    from quantkit import formats, methods

    assert list(methods.registered())[-2:] == ["toy-int8", "toy-round"]  # after the built-in ones
    assert list(formats.registered())[-2:] == ["toy-int8", "transformers"]  # before the catch-all checkpoint
    assert methods.get_method("toy-int8").format is formats.get_format("toy-int8")


def report_of(out):
    return json.loads((out / "quantkit.json").read_text())["targets"][0]


def test_a_method_on_an_existing_format(plugins, cli, micro_model, tmp_path):
    from quantkit.formats import detect, gate

    out = tmp_path / "rounded"
    result = cli("quantize", micro_model, "--method", "toy-round", "--bits", "4", *CALIB, "-o", out)
    assert result.exit_code == 0, result.output
    target = report_of(out)
    assert target["method"] == "toy-round" and target["options"] == {"bits": 4} and target["details"]["rounded"] == 14
    assert detect(out).kind == "transformers" and gate.artifact_reading(out) is not None  # read by quantkit
    assert 0 < target["metrics"]["kld_mean"] < 0.05 and target["gate"]["passed"]
    assert target["details"]["serving"]["serve"] == "vllm serve ."  # the format's serve command


def test_a_new_format_and_its_method(plugins, cli, micro_model, tmp_path):
    from quantkit.formats import detect, gate
    from quantkit.run import preflight

    out = tmp_path / "int8"
    result = cli("quantize", micro_model, "--method", "toy-int8", *CALIB, "-o", out)
    assert result.exit_code == 0, result.output
    target = report_of(out)
    fmt = detect(out)
    assert fmt.kind == "toy-int8" and gate.artifact_reading(out) is not None  # the gate used the format's reading
    assert 0 < target["metrics"]["kld_mean"] < 0.01 and math.isfinite(target["metrics"]["ppl"])
    card = (out / "README.md").read_text()
    assert "- toy-int8" in card and "no runtime" in card  # tags and the serving line from the format
    assert preflight.whole_bytes(preflight_info(micro_model), fmt.gate_dtype) == 4 * preflight_params(micro_model)
    evaluated = cli("eval", out, "--against", micro_model, "--num-windows", "2", "--seq-len", "128", "--json", "-")
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["kind"] == "toy-int8"
    served = cli("serve-check", out, "--against", micro_model)
    assert served.exit_code == 2 and "no serving engine for a 'toy-int8' artifact" in served.output


def preflight_info(model):
    from quantkit.io.checkpoint import check_model_dir

    return check_model_dir(model)


def preflight_params(model):
    return sum(math.prod(shape) for _dtype, shape in preflight_info(model).tensors.values())


def test_the_development_page_shows_the_plugins_own_code():
    """docs/development.md's worked examples are the tested code, declaration for declaration."""
    from tests.util import REPO

    page = (REPO / "docs" / "development.md").read_text()
    blocks = [block.split("```", 1)[0] for block in page.split("```python\n")[1:]]
    sources = " ".join((REPO / "tests" / "plugins" / name).read_text() for name in ("toy_round.py", "toy_int8.py"))
    assert len(blocks) == 2
    for block in blocks:
        assert " ".join(block.split()) in " ".join(sources.split())
