"""serve-check's tokenization check without an engine: the comparison, its report and verdict, and the
engines' /tokenize requests against the stub server's canned answers (in each engine's response shape)."""

import os
import sys
from pathlib import Path

import pytest

from quantkit.serve import check, llama_server, process, tokens, vllm_server
from quantkit.serve.settings import Endpoint
from tests.serve.test_check import EXACT, agreement, report

STUB = Path(__file__).with_name("stub_server.py")
PIECES = {1: "<s>", 10: "Hello", 11: " world", 12: "!", 13: " Bye", 14: " ", 15: "world"}


def test_first_difference():
    assert tokens.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert tokens.first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert tokens.first_difference([1, 2], [1, 2, 3]) == 2
    assert tokens.first_difference([], []) is None


def test_the_first_difference_is_shown_with_its_pieces():
    """' world' as one token against ' ' + 'world': the engine's pre-tokenizer splits the space off."""
    ours = [[1, 10, 12], [1, 10, 11, 12, 13]]
    theirs = [[1, 10, 12], [1, 10, 14, 15, 12, 13]]
    result = tokens.compare(ours, theirs, PIECES.get)
    assert (result.texts, result.tokens, result.differing, result.matches) == (2, 8, 1, False)
    first = result.first
    assert (first.text, first.position, first.start, first.length, first.engine_length) == (1, 2, 0, 5, 6)
    assert first.ids == [1, 10, 11, 12, 13] and first.engine_ids == [1, 10, 14, 15, 12, 13]
    assert first.describe() == ("text 2, token 3 of 5 (engine: 6): Hugging Face [1 '<s>', 10 'Hello', 11 ' world', "
                                "12 '!', 13 ' Bye'] vs engine [1 '<s>', 10 'Hello', 14 ' ', 15 'world', 12 '!', "
                                "13 ' Bye']")


def test_a_long_text_shows_three_tokens_on_each_side():
    ours, theirs = list(range(20)), list(range(10)) + [99] + list(range(11, 20))
    first = tokens.compare([ours], [theirs], str).first
    assert first.start == 7 and first.ids == [7, 8, 9, 10, 11, 12, 13] and first.engine_ids == [7, 8, 9, 99, 11, 12, 13]
    assert first.describe().startswith("text 1, token 11 of 20 (engine: 20): Hugging Face [… 7 '7', ")
    assert first.describe().endswith("13 '13' …]")


def test_equal_ids_match():
    result = tokens.compare([[1, 2], [1, 3]], [[1, 2], [1, 3]], str)
    assert result.matches and result.first is None and result.as_dict()["matches"] is True


def test_window_text_drops_the_bos_that_tokenizing_adds_back(micro_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(micro_model)
    body = tokenizer("The quick brown fox jumps.", add_special_tokens=False)["input_ids"]
    window = [tokenizer.bos_token_id, *body]
    texts, ids = tokens.reference(tokenizer, [window])
    assert texts == ["The quick brown fox jumps."]
    assert ids == [tokenizer("The quick brown fox jumps.")["input_ids"]]


def test_a_differing_tokenization_fails_the_verdict():
    differing = tokens.compare([[1, 10, 11]], [[1, 10, 14, 15]], PIECES.get)
    result = report(agreement(0.001), EXACT, check.Tolerances())
    result.tokenization = differing
    result.checks = check.verdict(result)
    assert result.failed == ["tokenization"]
    assert check.failures(result) == (
        "tokenization differs in 1 of 1 held-out texts, first at text 1, token 3 of 3 (engine: 4): "
        "Hugging Face [1 '<s>', 10 'Hello', 11 ' world'] vs engine [1 '<s>', 10 'Hello', 14 ' ', 15 'world']")
    assert result.as_dict()["tokenization"]["first"]["position"] == 2


@pytest.fixture
def stub_server(tmp_path):
    port = process.free_port()
    command = [sys.executable, str(STUB), str(port)]
    with process.running(command, dict(os.environ), port, "/health", tmp_path / "stub.log", 30, "stub") as server:
        yield Endpoint(server.url, tokenizer=None, vocab_size=8)


def test_engines_ask_for_their_own_ids(stub_server):
    """llama-server's /tokenize with BOS added and special tokens parsed; vLLM's with add_special_tokens (the
    stub answers 400 to any other request)."""
    assert llama_server.tokenize(stub_server, None, ["Hello world", "x"]) == [[1, 15043, 3186], [1, 29916]]
    assert vllm_server.tokenize(stub_server, None, ["Hello world"]) == [[1, 15043, 3186]]


@pytest.mark.slow  # fast through mlx_lm.server: tests/serve/test_serve_check_mlx.py's tokenization check
def test_mlx_lm_tokenizes_with_the_tokenizer_its_server_loads(micro_model):
    """mlx_lm.server has no /tokenize: the engine's python loads the served directory's tokenizer as the server
    does (here: this interpreter, which has mlx-lm) and gives the Hugging Face tokenizer's ids."""
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    from transformers import AutoTokenizer

    from quantkit.serve import mlx_server
    from quantkit.serve.engines import Installed

    texts = ["The quick brown fox.", "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich."]
    endpoint = Endpoint("http://127.0.0.1:1", tokenizer=None, vocab_size=0, model=micro_model)
    ids = mlx_server.tokenize(endpoint, Installed("mlx", Path(sys.executable), "this python"), texts)
    tokenizer = AutoTokenizer.from_pretrained(micro_model)
    assert ids == [tokenizer(text)["input_ids"] for text in texts]
