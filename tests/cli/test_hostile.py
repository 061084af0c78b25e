"""Damaged and mismatched inputs: each fails with exit 2 and one error line naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from quantkit.io.safetensors import safetensors_layout
from tests.util import FAST_CALIB, leftovers

WEIGHT = "model.layers.1.mlp.down_proj.weight"


def expect_bad_input(result, tmp_path, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert leftovers(tmp_path, "out") == []
    return lines[0]


def quantize(cli, model, tmp_path, *extra):
    return cli("quantize", model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB, *extra)


def rewrite_header(file: Path, edit) -> None:
    """Rewrite a safetensors header through `edit(header) -> header`, keeping the data bytes."""
    header, start = safetensors_layout(file)
    data = file.read_bytes()[start:]
    raw = json.dumps(edit(header)).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def set_value(file: Path, tensor: str, index: int, bf16_bits: int) -> None:
    header, start = safetensors_layout(file)
    assert header[tensor]["dtype"] == "BF16"
    offset = start + header[tensor]["data_offsets"][0] + 2 * index
    with open(file, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<H", bf16_bits))


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (model / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("bits, what", [(0x7FC0, "NaN"), (0xFF80, "-Inf")])
def test_nonfinite_weight(cli, model_copy, tmp_path, bits, what):
    set_value(model_copy / "model.safetensors", WEIGHT, 1234, bits)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, WEIGHT, "model.safetensors", "NaN/Inf")


def _overlap(header):
    header[WEIGHT]["data_offsets"] = [0, header[WEIGHT]["data_offsets"][1] - header[WEIGHT]["data_offsets"][0]]
    return header


def _bigger_shape(header):
    header[WEIGHT]["shape"] = [512, 512]
    return header


def _strings(header):
    header[WEIGHT]["data_offsets"] = ["0", "x"]
    return header


def _unknown_dtype(header):
    header[WEIGHT]["dtype"] = "F4_MAGIC"
    return header


def _not_an_object(header):
    return [1, 2, 3]


@pytest.mark.parametrize("edit, needle", [
    (_overlap, "overlapping or gapped"), (_bigger_shape, "inconsistent size"), (_strings, "malformed"),
    (_unknown_dtype, "malformed"), (_not_an_object, "corrupt safetensors header")])
def test_lying_safetensors_header(cli, model_copy, tmp_path, edit, needle):
    rewrite_header(model_copy / "model.safetensors", edit)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "model.safetensors", needle)


def test_trailing_bytes_after_the_last_tensor(cli, model_copy, tmp_path):
    with open(model_copy / "model.safetensors", "ab") as fh:
        fh.write(b"\0" * 64)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "model.safetensors", "64 bytes follow")


def test_integer_weight_in_a_float_checkpoint(cli, model_copy, tmp_path):
    rewrite_header(model_copy / "model.safetensors", lambda h: {**h, WEIGHT: {**h[WEIGHT], "dtype": "I16"}})
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "model.safetensors", WEIGHT, "I16")


def test_shapes_disagree_with_config(cli, model_copy, tmp_path):
    edit_config(model_copy, intermediate_size=384)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "disagree with config.json", "mlp")


def test_config_missing_required_fields(cli, model_copy, tmp_path):
    edit_config(model_copy, hidden_size=None, num_hidden_layers=None, vocab_size=None)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "config.json")


def test_checkpoint_missing_a_layer(cli, model_copy, tmp_path):
    edit_config(model_copy, num_hidden_layers=3)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "config.json", "model.layers.2.")


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0", "model": {"type": "BPE"}}', ""])
def test_tokenizer_that_fails_to_load(cli, model_copy, tmp_path, content):
    (model_copy / "tokenizer.json").write_text(content)
    expect_bad_input(quantize(cli, model_copy, tmp_path), tmp_path, "no usable tokenizer", "tokenizer.json")


# ---------------------------------------------------------------- gguf


@pytest.fixture(scope="module")
def gguf_path(micro_model, tmp_path_factory) -> Path:
    from quantkit.gguf.convert import convert

    path = tmp_path_factory.mktemp("gguf") / "micro-Q8_0.gguf"
    convert(micro_model, path, "Q8_0", name="micro")
    return path


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _header_only(data: bytes) -> bytes:
    return data[:16]


def _scribble(data: bytes) -> bytes:
    return data[:30] + b"\xff" * 30 + data[60:]


def _not_gguf(data: bytes) -> bytes:
    return b"hello world " * 10


@pytest.mark.parametrize("damage", [_truncate, _header_only, _scribble, _not_gguf])
def test_eval_of_a_damaged_gguf(cli, micro_model, gguf_path, tmp_path, damage):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(gguf_path.read_bytes()))
    result = cli("eval", bad, "--against", micro_model, "--num-windows", 2, "--seq-len", 64)
    assert result.exit_code == 2, result.output
    assert "bad.gguf" in result.stderr and "Traceback" not in result.output


def _imatrix(tmp_path: Path, names_cols: dict[str, int]) -> Path:
    from quantkit.gguf import imatrix as im

    matrix = im.Imatrix(sums={n: np.ones((1, c), np.float32) for n, c in names_cols.items()},
                        counts={n: np.array([4.0], np.float32) for n in names_cols}, datasets=["other"],
                        chunk_count=4, chunk_size=64)
    return im.write(matrix, tmp_path / "other.imatrix.gguf")


@pytest.mark.parametrize("entries, needle", [
    ({"blk.0.attn_q.weight": 64, "blk.0.ffn_down.weight": 172}, "columns"),
    ({"blk.0.attn_q.weight": 256, "blk.7.attn_q.weight": 256}, "lacks")])
def test_imatrix_of_another_model(cli, micro_model, tmp_path, entries, needle):
    path = _imatrix(tmp_path, entries)
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", path,
                 "-o", tmp_path / "out", *FAST_CALIB)
    expect_bad_input(result, tmp_path, "other.imatrix.gguf", needle, "another model")


def test_imatrix_file_that_is_not_one(cli, micro_model, tmp_path):
    path = tmp_path / "junk.imatrix"
    path.write_bytes(b"GGUF" + b"\x00" * 10)
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", path,
                 "-o", tmp_path / "out", *FAST_CALIB)
    expect_bad_input(result, tmp_path, "junk.imatrix")


@pytest.fixture(scope="module")
def fp8_artifact(micro_model, tmp_path_factory) -> Path:
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    out = tmp_path_factory.mktemp("artifacts") / "fp8"
    result = CliRunner().invoke(app, ["quantize", str(micro_model), "--method", "fp8", "-o", str(out), *FAST_CALIB])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("damage", ["truncate", "config"])
def test_eval_of_a_damaged_checkpoint_artifact(cli, micro_model, fp8_artifact, tmp_path, damage):
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(fp8_artifact, artifact)
    if damage == "truncate":
        weights = artifact / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        needle = "model.safetensors"
    else:
        (artifact / "config.json").write_text("[1, 2")
        needle = "config.json"
    result = cli("eval", artifact, "--against", micro_model, "--num-windows", 2, "--seq-len", 64)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output
