"""Every family against llama.cpp's tools (slow; skipped without scripts/build_llamacpp.sh's build).

For each tiny family checkpoint (stored in f16, so quantkit's F16 GGUF holds exactly the source
values): llama-quantize on that F16 file gives, for all 14 mixtures, the same tensor types and
bytes as quantkit's direct conversion; with an imatrix that llama-imatrix computed on the F16
file, the same holds for the k-quant and legacy mixtures; llama-perplexity loads and runs
quantkit's Q4_K_M file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.families import build_family
from tests.gguf.helpers import ALL_MIXES, convert_to, need_llama, run_quantize, save_f16_copy, tensor_bytes

FAMILIES = ["llama31", "llama32", "mistral", "mixtral", "mixtral8", "qwen25", "qwen3moe", "gemma3", "gemma3vlm",
            "phi3", "phi4"]
TOKENIZER = {"mistral": "spm", "phi3": "spm", "gemma3vlm": "spm"}
IMATRIX_MIXES = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
                 "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
_BUILT: dict[str, dict] = {}


def text_file(path: Path) -> Path:
    from quantkit.toy import bundled_texts

    path.write_text("\n".join(bundled_texts())[:20000])
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> dict:
    """{model: f16 checkpoint, f16: quantkit's F16 GGUF, imatrix: llama-imatrix's file}."""
    name = request.param
    if name not in _BUILT:
        need_llama("llama-quantize")
        root = tmp_path_factory.mktemp(f"llamacpp-{name}")
        model = save_f16_copy(build_family(name, root / "bf16", TOKENIZER.get(name, "bpe")), root / "f16")
        f16 = root / "f16.gguf"
        convert_to(model, f16, "F16")
        imatrix = root / "imatrix.gguf"
        run = subprocess.run([str(need_llama("llama-imatrix")), "-m", str(f16), "-f", str(text_file(root / "t.txt")),
                              "-c", "128", "-b", "128", "--chunks", "4", "-t", "2", "-o", str(imatrix)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and imatrix.is_file(), run.stderr[-2000:]
        _BUILT[name] = {"name": name, "model": model, "f16": f16, "imatrix": imatrix}
    return _BUILT[name]


def assert_same_tensors(theirs: Path, ours: Path, label: str) -> None:
    a, b = tensor_bytes(theirs), tensor_bytes(ours)
    assert list(a) == list(b), f"{label}: tensor order"
    for name in a:
        assert a[name][0] == b[name][0], f"{label} {name}: type {b[name][0]} != llama-quantize {a[name][0]}"
        assert a[name][1] == b[name][1], f"{label} {name} ({a[name][0]}): bytes differ"


@pytest.mark.slow
def test_all_mixtures_bit_exact(family, tmp_path):
    for gguf_type in ALL_MIXES:
        theirs, ours = tmp_path / f"theirs-{gguf_type}.gguf", tmp_path / f"ours-{gguf_type}.gguf"
        run_quantize(family["f16"], theirs, gguf_type)
        convert_to(family["model"], ours, gguf_type)
        assert_same_tensors(theirs, ours, f"{family['name']} {gguf_type}")


@pytest.mark.slow
def test_mixtures_with_imatrix_bit_exact(family, tmp_path):
    from quantkit.gguf import imatrix as im

    weights = im.read(family["imatrix"]).weights()
    for gguf_type in IMATRIX_MIXES:
        theirs, ours = tmp_path / f"theirs-{gguf_type}.gguf", tmp_path / f"ours-{gguf_type}.gguf"
        run_quantize(family["f16"], theirs, gguf_type, imatrix=family["imatrix"])
        result = convert_to(family["model"], ours, gguf_type, imatrix=weights)
        assert result.imatrix_tensors > 0
        assert_same_tensors(theirs, ours, f"{family['name']} {gguf_type} + imatrix")


@pytest.mark.slow
def test_llama_perplexity_loads(family, tmp_path):
    """llama-perplexity loads quantkit's Q4_K_M file and scores chunks (its per-chunk "[i]ppl,"
    lines are read: under load its log thread sometimes drops the final estimate line)."""
    exe = need_llama("llama-perplexity")
    path = tmp_path / "q4.gguf"
    convert_to(family["model"], path, "Q4_K_M")
    run = subprocess.run([str(exe), "-m", str(path), "-f", str(text_file(tmp_path / "t.txt")), "-c", "128",
                          "-b", "128", "--chunks", "3", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    chunks = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", run.stdout + run.stderr)]
    assert len(chunks) >= 2 and all(np.isfinite(v) and v > 1.0 for v in chunks), run.stderr[-2000:]
