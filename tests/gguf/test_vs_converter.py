"""quantkit's GGUF equals convert_hf_to_gguf.py's: every metadata key and every tensor.

Runs llama.cpp's own converter (third_party/llama.cpp/src, with its own gguf-py) on the tiny
family checkpoints of tests/gguf/families.py and compares its file with quantkit's at the same
output type (f32: exact source values; bf16). Skipped, saying so, without the llama.cpp source.

Keys left out of the comparison, and why: general.name / basename / finetune / version /
size_label / license* / tags / languages / base_model* / datasets / quantized_by / url / repo_url
are descriptive labels that gguf.Metadata guesses from the directory name and model card
(quantkit names the model after its directory; llama.cpp never reads them to run a model).

The toy BPE tokenizer's pre-tokenizer hash is not in the converter's table of known models (it
refuses such tokenizers); for it the converter runs with get_vocab_base_pre patched to return
"gpt-2", the name quantkit derives from the tokenizer's structure (a plain ByteLevel regex).
SentencePiece tokenizers need no such patch, nor do the real Llama 3 and Qwen2 vocabularies
rebuilt from llama.cpp's vocab test files (their hashes are in the table: "llama-bpe", "qwen2").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.families import build_family
from tests.gguf.helpers import convert_to

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SRC = ROOT / "third_party" / "llama.cpp" / "src"
DESCRIPTIVE = ("general.name", "general.basename", "general.finetune", "general.version", "general.size_label",
               "general.license", "general.tags", "general.languages", "general.base_model", "general.dataset",
               "general.quantized_by", "general.url", "general.repo_url", "general.organization",
               "general.description", "general.author", "general.source")
RUNNER = """
import runpy, sys
sys.path.insert(0, {src!r})
if {pre!r}:
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""
CASES = [("llama31", "bpe"), ("llama31", "spm"), ("llama32", "bpe"), ("mistral", "spm"), ("mixtral", "spm"),
         ("mixtral8", "bpe"), ("qwen25", "bpe"), ("qwen3moe", "bpe"), ("gemma3", "spm"), ("gemma3", "bpe"),
         ("gemma3vlm", "spm"), ("phi3", "spm"), ("phi4", "bpe"), ("llama31", "llama-bpe"), ("qwen25", "qwen2")]
_BUILT: dict[str, Path] = {}


def need_llama_src() -> Path:
    if not (LLAMA_SRC / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp source not present (run scripts/build_llamacpp.sh)")
    return LLAMA_SRC


def run_converter(model: Path, out: Path, outtype: str, pre: str | None,
                  extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """convert_hf_to_gguf.py run with llama.cpp's own gguf-py (`extra`: more converter options)."""
    src = need_llama_src()
    code = RUNNER.format(src=str(src), pre=pre, script=str(src / "convert_hf_to_gguf.py"),
                         args=[str(model), "--outtype", outtype, "--outfile", str(out), *extra])
    env = {**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def reference_gguf(model: Path, out: Path, outtype: str, pre: str | None, extra: tuple[str, ...] = ()) -> Path:
    """convert_hf_to_gguf.py's output (`extra`: more converter options)."""
    run = run_converter(model, out, outtype, pre, extra)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def metadata(path: Path) -> dict:
    import gguf

    out = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("GGUF.") or key.startswith(DESCRIPTIVE):
            continue
        value = field.contents()
        out[key] = np.asarray(value, dtype=np.float32).tolist() if isinstance(value, float) else value
    return out


def tensors(path: Path) -> dict[str, tuple[str, tuple, bytes]]:
    import gguf

    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), bytes(np.asarray(t.data).tobytes()))
            for t in gguf.GGUFReader(str(path)).tensors}


def family_model(tmp_path_factory, family: str, tokenizer: str) -> Path:
    key = f"{family}-{tokenizer}"
    if key not in _BUILT:
        _BUILT[key] = build_family(family, tmp_path_factory.mktemp("vs-converter") / key, tokenizer,
                                   vocab_dir=LLAMA_SRC / "models")
    return _BUILT[key]


def assert_same_file(ours: Path, theirs: Path) -> None:
    a, b = metadata(theirs), metadata(ours)
    assert sorted(a) == sorted(b), f"keys only in llama.cpp's: {sorted(set(a) - set(b))}, " \
                                   f"only in quantkit's: {sorted(set(b) - set(a))}"
    for key in a:
        assert a[key] == b[key], f"{key}: quantkit {str(b[key])[:200]} != converter {str(a[key])[:200]}"
    ta, tb = tensors(theirs), tensors(ours)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name][:2] == tb[name][:2], f"{name}: {tb[name][:2]} != converter {ta[name][:2]}"
        assert ta[name][2] == tb[name][2], f"{name}: bytes differ"


@pytest.mark.slow
@pytest.mark.parametrize("family,tokenizer", CASES, ids=[f"{f}-{t}" for f, t in CASES])
@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_equal_to_convert_hf_to_gguf(tmp_path_factory, tmp_path, family, tokenizer, outtype):
    need_llama_src()
    model = family_model(tmp_path_factory, family, tokenizer)
    theirs = reference_gguf(model, tmp_path / "theirs.gguf", outtype, "gpt-2" if tokenizer == "bpe" else None)
    ours = tmp_path / "ours.gguf"
    result = convert_to(model, ours, outtype.upper())
    assert_same_file(ours, theirs)
    if tokenizer in ("llama-bpe", "qwen2"):  # found by the converter's own hash table
        assert result.vocab["pre"] == tokenizer and result.vocab["pre_source"] == "hash"
