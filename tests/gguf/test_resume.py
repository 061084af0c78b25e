"""A conversion's saved progress (quantkit.gguf.resume): continued after the last tensor that verifies,
byte-identical to an uninterrupted conversion; progress of another header or imatrix is not used."""

from __future__ import annotations

import numpy as np

from quantkit.gguf import resume
from quantkit.gguf.convert import convert


def cut_after(path, state, kept: int, torn: bool = False) -> None:
    """As a kill leaves it: `kept` tensors recorded, the file ending inside the next one (or, torn, inside the
    last recorded one, whose bytes a power loss did not write)."""
    saved = resume.load(state)
    saved.tensors = saved.tensors[:kept]
    resume.save(state, saved)
    last = saved.tensors[-1]
    end = last.offset + last.nbytes // 2 if torn else last.offset + last.nbytes + 100
    with open(path, "r+b") as fh:
        fh.truncate(end)


def test_conversion_continues_after_the_last_recorded_tensor(micro_model, tmp_path):
    plain = convert(micro_model, tmp_path / "plain.gguf", "Q8_0").path.read_bytes()
    out, state = tmp_path / "out.gguf", tmp_path / "state.json"
    convert(micro_model, out, "Q8_0", state=state)
    assert out.read_bytes() == plain and len(resume.load(state).tensors) == 21
    cut_after(out, state, 9)
    said: list[str] = []
    convert(micro_model, out, "Q8_0", state=state, progress=said.append)
    assert "out.gguf: resuming after 9 of 21 tensors (verified by sha256)" in said
    assert [m for m in said if m.startswith("converting:")][0].endswith("(10/21)")
    assert out.read_bytes() == plain


def test_a_torn_tensor_is_written_again(micro_model, tmp_path):
    plain = convert(micro_model, tmp_path / "plain.gguf", "Q8_0").path.read_bytes()
    out, state = tmp_path / "out.gguf", tmp_path / "state.json"
    convert(micro_model, out, "Q8_0", state=state)
    cut_after(out, state, 12, torn=True)
    said: list[str] = []
    convert(micro_model, out, "Q8_0", state=state, progress=said.append)
    assert "out.gguf: resuming after 11 of 21 tensors (verified by sha256); 1 recorded tensor(s) did not verify" in said
    assert out.read_bytes() == plain


def test_progress_of_another_header_is_not_used(micro_model, tmp_path):
    out, state = tmp_path / "out.gguf", tmp_path / "state.json"
    convert(micro_model, out, "Q8_0", state=state)
    cut_after(out, state, 9)
    said: list[str] = []
    convert(micro_model, out, "F16", state=state, progress=said.append)
    assert ("out.gguf: the saved progress was written with another header (types, shapes or metadata); "
            "writing it from the start") in said
    assert out.read_bytes() == convert(micro_model, tmp_path / "f16.gguf", "F16").path.read_bytes()


def test_the_imatrix_is_part_of_the_progress_identity():
    one = {"blk.0.ffn_down.weight": np.ones(4, np.float32)}
    assert resume.imatrix_digest(None) == ""
    assert resume.imatrix_digest(one) == resume.imatrix_digest({k: v.copy() for k, v in one.items()})
    assert resume.imatrix_digest(one) != resume.imatrix_digest({"blk.0.ffn_down.weight": np.full(4, 2, np.float32)})


def test_unreadable_progress_is_no_progress(tmp_path):
    state = tmp_path / "state.json"
    assert resume.load(state) is None
    state.write_text('{"header_sha256": "x", "tensors": [')  # torn by a power loss before the rename
    assert resume.load(state) is None
