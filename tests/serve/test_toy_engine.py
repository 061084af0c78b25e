"""A new serving engine plugs in through the registry only (docs/development.md, "A new serving engine"):
the toy engine (tests/serve/toy_engine.py, a transformers server in a process of its own) registered as
"toy" is found, started, asked and stopped by `quantkit serve-check`, and judged like the real engines."""

import json

import pytest

from quantkit.serve import engines


@pytest.fixture
def toy(monkeypatch):
    """The toy engine in the registry, the line an engine adds (quantkit/serve/engines.py: ENGINES), and named by
    the format it loads (quantkit/formats/transformers.py: engines), the line a format adds for it."""
    from dataclasses import replace

    from quantkit.formats import transformers

    monkeypatch.setitem(engines.ENGINES, "toy", "tests.serve.toy_engine")
    monkeypatch.setattr(transformers, "FORMAT", replace(transformers.FORMAT, engines=(*transformers.FORMAT.engines, "toy")))


def test_the_toy_engine_implements_the_protocol(toy):
    assert isinstance(engines.get_engine("toy"), engines.Engine)
    assert "toy" in engines.choices().split(" | ")


def test_a_recipe_names_a_registered_engine(toy):
    from quantkit.errors import RecipeError
    from quantkit.run.recipe import validate

    recipe = {"model": "m", "targets": [{"name": "a", "method": "fp8"}], "gate": {"serve": {"engine": "toy"}}}
    assert validate(recipe).gate.serve.engine == "toy"
    with pytest.raises(RecipeError, match="unknown engine 'tgi'; allowed: auto, vllm, llama.cpp, mlx, toy"):
        validate({**recipe, "gate": {"serve": {"engine": "tgi"}}})


SMALL = ("--num-windows", "2", "--seq-len", "32", "--gen-prompts", "2", "--gen-tokens", "4", "--load-tokens", "4",
         "--concurrency", "1")


def test_serve_check_runs_a_registered_engine(cli, micro_model, model_copy, tmp_path, toy):
    """The artifact (a plain checkpoint) served by the toy server reads as quantkit reads it, and the
    server tokenizes the held-out text as the Hugging Face tokenizer does."""
    out = tmp_path / "serve.json"
    result = cli("serve-check", model_copy, "--engine", "toy", "--against", micro_model, *SMALL, "--json", out)
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["engine"]["name"] == "toy" and report["engine"]["version"] == "toy-server 1"
    assert report["passed"] and report["tokenization"]["matches"] and report["tokenization"]["texts"] == 2
    assert report["vs_reading"]["kld_lower_bound"] < 1e-4  # transformers in float32 against quantkit's reading
    assert {c["name"] for c in report["checks"]} == {"reading_kld", "ppl_drift", "tokenization"}


# the verdict fast: tests/serve/test_tokens.py (test_a_differing_tokenization_fails_the_verdict); serve-check's exit 3
# fast: tests/serve/test_serve_gate.py
@pytest.mark.slow
def test_an_engine_that_tokenizes_differently_fails_the_check(cli, micro_model, model_copy, tmp_path, toy,
                                                             monkeypatch):
    """The same server, its tokenizer splitting text one character at a time: the log-probs of the ids agree,
    the tokenization does not, and the check fails (exit 3) naming the first differing token."""
    monkeypatch.setenv("TOY_SERVER_TOKENIZE", "chars")
    out = tmp_path / "serve.json"
    result = cli("serve-check", model_copy, "--engine", "toy", "--against", micro_model, *SMALL, "--json", out)
    assert result.exit_code == 3, result.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == ["tokenization"] and report["tokenization"]["differing"] == 2
    first = report["tokenization"]["first"]
    assert first["text"] == 0 and first["ids"][first["position"] - first["start"]] != \
        first["engine_ids"][first["position"] - first["start"]]
    assert "tokenization differs in 2 of 2 held-out texts, first at text 1, token" in result.stderr
