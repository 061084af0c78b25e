"""Gemma (GemmaForCausalLM) and Gemma 2 (Gemma2ForCausalLM) -> GGUF, as convert_hf_to_gguf.py's
GemmaModel / Gemma2Model do it (conversion/gemma.py in llama.cpp 0c1e570): norm weights + 1,
lm_head dropped (the output is the tied token embedding), their own metadata (no RoPE keys; Gemma 2:
logit softcaps and sliding window), names through gguf-py's GEMMA / GEMMA2 maps.

Models: random init (norm weights randomised too, HF initialises them to 0), hidden 256, 2 layers,
head_dim 64, the toy BPE tokenizer, stored in bf16. The llama.cpp tests skip without
scripts/build_llamacpp.sh's build.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.helpers import (
    build_gemma,
    convert_to,
    fields,
    load_gguf_model,
    need_llama,
    run_quantize,
    save_f16_copy,
    tensor_bytes,
)
from tests.util import FAST_CALIB


def run_perplexity(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float | None]:
    """llama-perplexity and its final PPL; run again (up to 3 times) when its log thread dropped the
    final estimate line at exit, which happens on a loaded machine."""
    for _attempt in range(3):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        match = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
        if match or run.returncode != 0:
            break
    return run, float(match.group(1)) if match else None


@pytest.fixture(scope="session", params=[1, 2], ids=["gemma", "gemma2"])
def gemma(request, tmp_path_factory) -> Path:
    key = f"gemma{request.param}"
    return build_gemma(tmp_path_factory.mktemp("gguf-gemma") / key, request.param)


def hf_config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def arch_of(model: Path) -> str:
    return "gemma" if hf_config(model)["architectures"][0] == "GemmaForCausalLM" else "gemma2"


def test_gemma_metadata_and_names(gemma, tmp_path):
    import gguf

    path = tmp_path / "g.gguf"
    result = convert_to(gemma, path, "Q8_0")
    meta, cfg, arch = fields(path), hf_config(gemma), arch_of(gemma)
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.block_count"] == 2
    assert meta[f"{arch}.context_length"] == 2048
    assert meta[f"{arch}.embedding_length"] == 256
    assert meta[f"{arch}.feed_forward_length"] == 512
    assert meta[f"{arch}.attention.head_count"] == 4 and meta[f"{arch}.attention.head_count_kv"] == 2
    assert meta[f"{arch}.attention.key_length"] == 64 and meta[f"{arch}.attention.value_length"] == 64
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert f"{arch}.rope.freq_base" not in meta and f"{arch}.vocab_size" not in meta  # GemmaModel writes neither
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    if arch == "gemma2":
        assert meta["gemma2.attn_logit_softcapping"] == pytest.approx(50.0)
        assert meta["gemma2.final_logit_softcapping"] == pytest.approx(30.0)
        assert meta["gemma2.attention.sliding_window"] == 32
    else:
        # GemmaModel.set_vocab's CodeGemma ids: gguf-py (0.19 and llama.cpp's own) only has a writer
        # for eot; prefix/suffix/middle/fsep are skipped with a warning there too
        assert meta["tokenizer.ggml.eot_token_id"] == 107 and "tokenizer.ggml.prefix_token_id" not in meta
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "output.weight" not in names and "token_embd.weight" in names
    extra = {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"}
    assert extra <= names if arch == "gemma2" else not (extra & names)
    assert result.tensors == len(names)


def test_gemma_mixture_token_embd_uses_output_rule(gemma):
    from quantkit.gguf.convert import plan_tensors
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(gemma)
    types = {p.name: p.qtype.name for p in plan_tensors(info.config, info.tensors, "Q4_K_M")}
    assert types["token_embd.weight"] == "Q6_K"
    assert all(t == "F32" for n, t in types.items() if n.endswith("norm.weight"))


def test_gemma_f32_round_trip_reproduces_logits(gemma, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path / "g.gguf"
    convert_to(gemma, path, "F32")
    base = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    loaded = load_gguf_model(path, gemma)
    ref = base.state_dict()
    for name, value in loaded.state_dict().items():
        if name in ref:
            torch.testing.assert_close(value, ref[name], rtol=0, atol=2e-7, msg=name)
    ids = torch.randint(0, hf_config(gemma)["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = base(ids).logits, loaded(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_gemma_norm_shift_in_source_dtype(gemma, tmp_path):
    """w + 1 as convert_hf_to_gguf.py computes it: f32 for a bf16 source (cast before
    modify_tensors), a torch half add for an f16 source."""
    import gguf
    import torch
    from safetensors.torch import load_file

    f16 = save_f16_copy(gemma, tmp_path / "f16")
    for model in (gemma, f16):
        path = tmp_path / f"{model.name}.gguf"
        convert_to(model, path, "F32")
        stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
        w = load_file(model / "model.safetensors")["model.norm.weight"]
        w = w if w.dtype == torch.float16 else w.float()
        np.testing.assert_array_equal(stored["output_norm.weight"], (w + 1).float().numpy())


def test_gemma_q8_0_pipeline_passes_gate(cli, gemma, tmp_path):
    out = tmp_path / "gguf"
    result = cli("quantize", gemma, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    target = report["targets"][0]
    assert target["details"]["gguf"]["tensor_types"]["Q8_0"] > 0
    assert target["metrics"]["kld_mean"] < 0.01 and target["gate"]["passed"]
    result = cli("eval", out, "--num-windows", "3", "--seq-len", "64", "--json", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kind"] == "gguf"


# ------------------------------------------------------------------ llama.cpp (slow)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", ["Q4_K_M", "Q2_K", "Q8_0"])
def test_gemma_bit_exact_with_llama_quantize(gemma, tmp_path, gguf_type):
    need_llama("llama-quantize")
    f16 = save_f16_copy(gemma, tmp_path / "f16")
    src, ours, theirs = tmp_path / "f16.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    convert_to(f16, src, "F16")
    convert_to(f16, ours, gguf_type)
    run_quantize(src, theirs, gguf_type)
    a, b = tensor_bytes(theirs), tensor_bytes(ours)
    assert list(a) == list(b)  # same tensor order
    for name in a:
        assert a[name][0] == b[name][0], f"{name}: type {b[name][0]} != llama-quantize {a[name][0]}"
        assert a[name][1] == b[name][1], f"{name} ({a[name][0]}): bytes differ"
    if gguf_type == "Q4_K_M":  # tied output: token_embd quantized with the output rule
        assert a["token_embd.weight"][0] == "Q6_K"


@pytest.mark.slow
def test_llama_perplexity_loads_gemma(gemma, tmp_path):
    perplexity = need_llama("llama-perplexity")
    path = tmp_path / "g.gguf"
    convert_to(gemma, path, "Q8_0")
    text = tmp_path / "text.txt"
    from quantkit.toy import bundled_texts

    text.write_text("\n".join(bundled_texts())[:20000])
    # -b = -c: one sequence per batch (with -c 64 and the default batch, 32 sequences for 4 chunks,
    # llama-perplexity sometimes exits 0 without an estimate)
    run, ppl = run_perplexity([str(perplexity), "-m", str(path), "-f", str(text), "-c", "128", "-b", "128",
                               "--chunks", "4", "-t", "2"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert ppl is not None and np.isfinite(ppl) and ppl > 1.0


@pytest.mark.slow
def test_llama_perplexity_of_f32_equals_hf(gemma, tmp_path):
    """llama.cpp reads the file as HF computes the model (norm + 1, tied output, Gemma 2's softcaps
    and 32-token sliding window over 128-token chunks): llama-perplexity's PPL of the F32 file equals
    the same computation in transformers (chunk's first token -> BOS, second half scored)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.toy import bundled_texts

    exe = need_llama("llama-perplexity")
    path, text = tmp_path / "f32.gguf", "\n".join(bundled_texts())[:20000]
    convert_to(gemma, path, "F32")
    (tmp_path / "text.txt").write_text(text)
    n, chunks = 128, 4
    run, llama = run_perplexity([str(exe), "-m", str(path), "-f", str(tmp_path / "text.txt"), "-c", str(n),
                                 "-b", str(n), "--chunks", str(chunks), "-t", "2"])
    assert run.returncode == 0 and llama is not None, run.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(gemma)
    ids = tok(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32, attn_implementation="eager").eval()
    nll, count = 0.0, 0
    for c in range(chunks):
        chunk = list(ids[c * n:(c + 1) * n])
        chunk[0] = tok.bos_token_id
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)
        for j in range(n // 2, n - 1):
            nll -= float(lp[j, chunk[j + 1]])
            count += 1
    assert llama == pytest.approx(math.exp(nll / count), rel=1e-4)
