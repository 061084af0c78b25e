"""`quantkit eval --llama-perplexity`: llama.cpp cross-check of a .gguf (optional build)."""

import json

import pytest

from quantkit.eval import llamacpp
from tests.util import FAST_CALIB


@pytest.fixture(scope="module")
def q8_dir(micro_model, tmp_path_factory, cli):
    out = tmp_path_factory.mktemp("q8") / "q8"
    assert cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB).exit_code == 0
    return out


def test_missing_binary_is_a_clear_error(cli, q8_dir, monkeypatch):
    monkeypatch.setattr(llamacpp, "find_binary", lambda name="llama-perplexity": None)
    result = cli("eval", q8_dir, "--num-windows", "3", "--seq-len", "64", "--llama-perplexity")
    assert result.exit_code == 2 and "llama-perplexity not found" in result.stderr


def test_only_for_gguf(cli, micro_model):
    result = cli("eval", micro_model, "--against", micro_model, "--llama-perplexity")
    assert result.exit_code == 2 and ".gguf artifacts only" in result.stderr


@pytest.mark.llamacpp
def test_llama_perplexity_scores_quantkit_file(cli, q8_dir):
    if llamacpp.find_binary() is None:
        pytest.skip("llama.cpp build not found: run scripts/build_llamacpp.sh")
    result = cli("eval", q8_dir, "--num-windows", "6", "--seq-len", "128", "--llama-perplexity", "--json", "-")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    ppl_llama, ppl_quantkit = row["llama_cpp"]["ppl"], row["metrics"]["ppl"]
    assert row["llama_cpp"]["chunks"] >= 1
    assert 0.5 < ppl_llama / ppl_quantkit < 2.0  # different tokenization and scoring, same model
