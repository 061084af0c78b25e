"""The proof that quantkit's llama.cpp KV-cache simulation is the engine's: on the same tokens of a tiny GGUF,
quantkit's KL divergence of the model with a simulated -ctk/-ctv cache over the same model with an unquantized one
equals llama-perplexity --kl-divergence with those cache types and -fa on over its f16-cache run of the same file,
with the rotation on and off (LLAMA_ATTN_ROT_DISABLE=1).

Same tokens: the text is tokenized as llama-perplexity does (BOS first when the vocabulary adds one), cut in chunks
of n_ctx with the chunk's first token replaced by BOS, and only the positions llama-perplexity scores (the second
half of each chunk, first = n_ctx / 2, predicting tokens first+1 .. n_ctx-1) are averaged.

Tolerance: |quantkit - llama.cpp| <= 20% of llama.cpp's mean KLD + 2e-5 (llama.cpp's f16 arithmetic in its base
run and its flash attention's f16 accumulation are not simulated; they move both runs alike).
"""

import os
import re
import subprocess

import numpy as np
import pytest

from quantkit.eval import llamacpp as llamacpp_bin

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp,
              pytest.mark.skipif(llamacpp_bin.find_binary() is None,
                                 reason="llama.cpp build not found: run scripts/build_llamacpp.sh")]

N_CTX = 128
CHUNKS = 6
PAIRS = [("q8_0", "q8_0", True), ("q4_0", "q4_0", True), ("q4_0", "q4_0", False), ("q8_0", "q4_0", True),
         ("iq4_nl", "iq4_nl", True), ("q5_1", "q5_1", True)]


def llama(*args, env=None) -> str:
    exe = llamacpp_bin.find_binary()
    cmd = [str(exe), *map(str, args), "-t", "2", "-c", str(N_CTX), "-b", str(N_CTX), "--chunks", str(CHUNKS)]
    for _attempt in range(6):
        text = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **(env or {})}).stdout
        if "Mean    KLD" in text or "Final estimate" in text:
            return text
    raise AssertionError(text[-2000:])


@pytest.fixture(scope="module")
def setup(odd_model, tmp_path_factory):
    from gguf import GGUFReader

    from quantkit.engines.transformers import load_tokenizer
    from quantkit.eval.artifacts import load_gguf_into_base
    from quantkit.gguf.convert import convert
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import load_texts

    tmp = tmp_path_factory.mktemp("kvproof")
    gguf = tmp / "model-F16.gguf"
    convert(odd_model, gguf, "F16")
    info = check_model_dir(odd_model)
    tokenizer = load_tokenizer(info, False)
    text = "\n\n".join(load_texts("default", tokenizer, chat_template=False, text_field="text"))[:200_000]
    (tmp / "text.txt").write_text(text)
    reader = GGUFReader(gguf)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    add_bos, bos = field("tokenizer.ggml.add_bos_token", False), field("tokenizer.ggml.bos_token_id")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ([bos] if add_bos else []) + ids
    windows = np.array(ids[:CHUNKS * N_CTX]).reshape(CHUNKS, N_CTX)
    if add_bos:
        windows[:, 0] = bos
    base_kld = tmp / "base.kld"
    llama("-m", gguf, "-f", tmp / "text.txt", "--kl-divergence-base", base_kld, "-ctk", "f16", "-ctv", "f16",
          "-fa", "on")
    model = load_gguf_into_base(gguf, odd_model)
    return gguf, tmp / "text.txt", base_kld, windows, model, len(ids)


def quantkit_kld(model, windows, k_type, v_type, rotation) -> float:
    import torch

    from quantkit.eval import kv
    from quantkit.eval.kv.attention import kv_cache

    shape = kv.shape_of(model.config)
    kind = kv.llamacpp_type(k_type, v_type, shape, rotation)
    ids = torch.from_numpy(windows)
    first = N_CTX // 2
    with torch.no_grad():
        base = model(ids).logits[:, first:N_CTX - 1].float().log_softmax(-1)
        with kv_cache(model, kind):
            cand = model(ids).logits[:, first:N_CTX - 1].float().log_softmax(-1)
    return float((base.exp() * (base - cand)).sum(-1).mean())


@pytest.mark.parametrize("k_type, v_type, rotation", PAIRS)
def test_simulated_kld_equals_llama_perplexity(setup, k_type, v_type, rotation):
    gguf, text, base_kld, windows, model, n_tokens = setup
    env = {} if rotation else {"LLAMA_ATTN_ROT_DISABLE": "1"}
    out = llama("-m", gguf, "-f", text, "--kl-divergence-base", base_kld, "--kl-divergence", "-ctk", k_type,
                "-ctv", v_type, "-fa", "on", env=env)
    engine = float(re.search(r"Mean\s+KLD:\s+([-0-9.eE+]+)", out).group(1))
    ours = quantkit_kld(model, windows, k_type, v_type, rotation)
    print(f"{k_type}/{v_type} rotation={rotation}: quantkit {ours:.6f} llama.cpp {engine:.6f}")
    assert abs(ours - engine) <= 0.2 * engine + 2e-5, (ours, engine)
