"""Tests for quantkit.run.calibration: sources, chat rendering, packing, errors."""

import json

import pytest
import torch

from quantkit.errors import CalibrationError
from quantkit.run import calibration
from quantkit.run.calibration import BUNDLED_NAMES, load_texts, make_windows, resolve_source, validate_source
from quantkit.run.recipe import Calibration

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE tokenizer trained on the bundled text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = [str(p) for p in resolve_source("default")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train(files, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def spec(**kwargs):
    base = dict(source="prose", num_samples=8, seq_len=64, eval_windows=4)
    return Calibration(**{**base, **kwargs})


# ---------------------------------------------------------------- sources


@pytest.mark.parametrize("name", BUNDLED_NAMES)
def test_bundled_sets_load(name, tokenizer):
    texts = load_texts(name, tokenizer)
    assert len(texts) > 20
    validate_source(name)
    windows = make_windows(tokenizer, spec(source=name))
    assert windows.calib.shape == (8, 64)


def test_default_mixes_all_four():
    parts = sum(len(load_texts(n, chat_template=False)) for n in BUNDLED_NAMES[1:])
    assert len(load_texts("default", chat_template=False)) == parts


def test_calibration_dir_override(tmp_path, monkeypatch):
    for filename in ("prose.txt", "chat.jsonl", "code.txt", "math.txt"):
        (tmp_path / filename).write_text('{"text": "x"}\n' if "json" in filename else "x")
    monkeypatch.setenv("QUANTKIT_CALIBRATION_DIR", str(tmp_path))
    assert resolve_source("prose") == [tmp_path / "prose.txt"]


def test_txt_documents_split_on_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("first doc\nstill first\n\n\nsecond doc\n  \nthird\n")
    assert load_texts(str(path)) == ["first doc\nstill first", "second doc", "third"]


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"body": "alpha"}, {"body": "beta"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_texts(str(path), text_field="body") == ["alpha", "beta"]


def test_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "one"}, "two"]))
    assert load_texts(str(path)) == ["one", "two"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a b c", "d e f"], "id": [1, 2]}), path)
    assert load_texts(str(path)) == ["a b c", "d e f"]


def test_chat_uses_template(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    assert load_texts(str(path), tokenizer) == ["<|user|>\nhi\n<|assistant|>\nhello\n"]
    plain = load_texts(str(path), tokenizer, chat_template=False)
    assert plain == ["user: hi\nassistant: hello"]


def test_chat_without_template_joins_roles(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    assert load_texts(str(path), tokenizer=None) == ["user: q"]


# ---------------------------------------------------------------- packing


def test_windows_deterministic_per_seed(tokenizer):
    a = make_windows(tokenizer, spec(seed=1))
    b = make_windows(tokenizer, spec(seed=1))
    c = make_windows(tokenizer, spec(seed=2))
    assert torch.equal(a.calib, b.calib) and torch.equal(a.eval, b.eval)
    assert a.sha256 == b.sha256 == c.sha256
    assert not torch.equal(a.calib, c.calib)


def test_calib_and_eval_disjoint(tokenizer):
    windows = make_windows(tokenizer, spec(num_samples=20, eval_windows=10))
    calib_rows = {tuple(r) for r in windows.calib.tolist()}
    eval_rows = {tuple(r) for r in windows.eval.tolist()}
    assert len(calib_rows) == 20 and len(eval_rows) == 10
    assert not calib_rows & eval_rows


def test_windows_start_with_bos(tokenizer):
    windows = make_windows(tokenizer, spec())
    assert windows.calib.dtype == torch.long
    assert (windows.calib[:, 0] == tokenizer.bos_token_id).all()
    assert (windows.eval[:, 0] == tokenizer.bos_token_id).all()
    assert (windows.calib[:, 1:] != tokenizer.bos_token_id).all()


def test_eos_between_documents(tmp_path, tokenizer):
    path = tmp_path / "d.txt"
    path.write_text("one two three\n\nfour five six\n")
    stream = calibration.token_stream(tokenizer, load_texts(str(path)))
    assert stream.count(tokenizer.eos_token_id) == 1


def test_zero_eval_windows(tokenizer):
    windows = make_windows(tokenizer, spec(eval_windows=0))
    assert windows.eval.shape == (0, 64)


def test_calib_dataset_columns(tokenizer):
    dataset = make_windows(tokenizer, spec()).calib_dataset()
    assert dataset.column_names == ["input_ids", "attention_mask"]
    assert len(dataset) == 8 and len(dataset[0]["input_ids"]) == 64


# ---------------------------------------------------------------- errors


def expect_error(match, fn, *args, **kwargs):
    with pytest.raises(CalibrationError, match=match) as info:
        fn(*args, **kwargs)
    assert info.value.hint
    assert info.value.exit_code == 2
    return info.value


def test_missing_file(tmp_path):
    expect_error("not found", validate_source, str(tmp_path / "nope.txt"))


def test_unknown_name_is_missing_file():
    error = expect_error("not found", resolve_source, "no-such-set")
    assert "default" in error.hint


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    expect_error("empty", validate_source, str(path))
    path.write_text("\n  \n")
    expect_error("empty", load_texts, str(path))


def test_malformed_jsonl_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken}\n')
    expect_error("line 2", load_texts, str(path))


def test_missing_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "x"}\n')
    error = expect_error("no 'text' field", load_texts, str(path))
    assert "body" in error.message


def test_unknown_extension(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    expect_error("unknown extension", validate_source, str(path))


def test_too_few_tokens(tmp_path, tokenizer):
    path = tmp_path / "small.txt"
    path.write_text("just a few words here")
    error = expect_error("are needed", make_windows, tokenizer, spec(source=str(path)))
    assert "gives 0 windows" in error.message and "12 are needed" in error.message
    assert "num_samples" in error.hint


def test_uncached_hf_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    error = expect_error(
        "not available in the local", load_texts, "hf:quantkit-test/definitely-absent"
    )
    assert "load_dataset" in error.hint


def test_hf_spec_parsing():
    parse = calibration.parse_hf_source
    assert parse("hf:wikitext") == ("wikitext", None, "train")
    assert parse("hf:wikitext:test") == ("wikitext", None, "test")
    assert parse("hf:wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", "train")
    assert parse("hf:a:b:validation[:10%]") == ("a", "b", "validation[:10%]")
    expect_error("not a valid hf", parse, "hf:")
