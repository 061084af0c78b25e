"""Per-tensor type choice vs llama-quantize (src/llama-quant.cpp llama_tensor_get_type_impl).

Expected tables are derived by hand from llama-quant.cpp (llama.cpp commit 0c1e570, the copy
llama-cpp-python 0.3.36 vendors); the optional slow test reads llama-quantize's actual output.
"""

from __future__ import annotations

import pytest
from gguf import LlamaFileType as F

from quantkit.gguf.mixture import ModelFacts, T, choose_types, file_type, type_counts, use_more_bits

LAYER_TENSORS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def model(n_layer: int, n_head: int = 32, n_head_kv: int = 8, hidden: int = 4096, ffn: int = 14336,
          vocab: int = 32000, tied: bool = False) -> dict:
    head_dim = hidden // n_head
    shapes = {"attn_q": (hidden, hidden), "attn_k": (n_head_kv * head_dim, hidden),
              "attn_v": (n_head_kv * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    t = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        t["output.weight"] = (vocab, hidden)
    for i in range(n_layer):
        t |= {f"blk.{i}.{n}.weight": s for n, s in shapes.items()}
        t |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,)}
    return t


def facts(n_layer, n_head=32, n_head_kv=8, **kw) -> ModelFacts:
    return ModelFacts("llama", n_layer, n_head, n_head_kv, **kw)


def layers_with(types: dict, tensor: str, qtype: T) -> list[int]:
    return sorted(int(n.split(".")[1]) for n, t in types.items() if n.endswith(f".{tensor}.weight") and t == qtype)


def test_use_more_bits_tables():
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(2) if use_more_bits(i, 2)] == [1]


# Llama-3-8B (32 layers, GQA 4): llama-quantize's well-known per-type tensor counts.
LLAMA3_8B_COUNTS = {
    "Q4_K_M": {"F32": 65, "Q4_K": 193, "Q6_K": 33},
    "Q2_K": {"F32": 65, "Q2_K": 129, "Q3_K": 64, "Q4_K": 32, "Q6_K": 1},
    "Q3_K_M": {"F32": 65, "Q3_K": 129, "Q4_K": 92, "Q5_K": 4, "Q6_K": 1},
    "Q3_K_S": {"F32": 65, "Q3_K": 225, "Q6_K": 1},
    "Q3_K_L": {"F32": 65, "Q3_K": 129, "Q5_K": 96, "Q6_K": 1},
    "Q4_K_S": {"F32": 65, "Q4_K": 217, "Q5_K": 8, "Q6_K": 1},
    "Q5_K_M": {"F32": 65, "Q5_K": 193, "Q6_K": 33},
    "Q5_K_S": {"F32": 65, "Q5_K": 225, "Q6_K": 1},
    "Q6_K": {"F32": 65, "Q6_K": 226},
    "Q8_0": {"F32": 65, "Q8_0": 226},
    "Q4_0": {"F32": 65, "Q4_0": 225, "Q6_K": 1},
    "F16": {"F16": 226, "F32": 65},
    "BF16": {"BF16": 226, "F32": 65},
}


@pytest.mark.parametrize("ftype", sorted(LLAMA3_8B_COUNTS))
def test_llama3_8b_counts(ftype):
    assert type_counts(choose_types(model(32), ftype, facts(32))) == LLAMA3_8B_COUNTS[ftype]


@pytest.mark.parametrize("n_layer,more", [(2, [1]), (8, [0, 3, 6, 7]),
                                          (32, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31])])
@pytest.mark.parametrize("ftype,base,bumped", [("Q4_K_M", T.Q4_K, T.Q6_K), ("Q5_K_M", T.Q5_K, T.Q6_K)])
def test_k_m_bumps_attn_v_and_ffn_down(n_layer, more, ftype, base, bumped):
    types = choose_types(model(n_layer), ftype, facts(n_layer))
    for tensor in ("attn_v", "ffn_down"):
        assert layers_with(types, tensor, bumped) == more
        assert layers_with(types, tensor, base) == [i for i in range(n_layer) if i not in more]
    for tensor in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert layers_with(types, tensor, base) == list(range(n_layer))
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == base


@pytest.mark.parametrize("n_head_kv,attn_v", [(8, T.Q4_K), (32, T.Q3_K)])  # n_gqa 4 vs 1
def test_q2_k_attn_v_depends_on_gqa(n_head_kv, attn_v):
    types = choose_types(model(8, n_head_kv=n_head_kv), "Q2_K", facts(8, n_head_kv=n_head_kv))
    assert layers_with(types, "attn_v", attn_v) == list(range(8))
    assert layers_with(types, "ffn_down", T.Q3_K) == list(range(8))
    assert layers_with(types, "attn_output", T.Q3_K) == list(range(8))
    assert types["token_embd.weight"] == T.Q2_K and types["output.weight"] == T.Q6_K


def test_q3_k_m_rules():
    types = choose_types(model(32), "Q3_K_M", facts(32))
    assert layers_with(types, "attn_v", T.Q5_K) == [0, 1]
    assert layers_with(types, "ffn_down", T.Q5_K) == [0, 1]  # i < n/16
    assert layers_with(types, "ffn_down", T.Q4_K) == list(range(2, 32))
    assert layers_with(types, "attn_output", T.Q4_K) == list(range(32))
    assert layers_with(types, "attn_q", T.Q3_K) == list(range(32))


def test_q4_k_s_rules():
    types = choose_types(model(8), "Q4_K_S", facts(8))
    assert layers_with(types, "attn_v", T.Q5_K) == [0, 1, 2, 3]
    assert layers_with(types, "ffn_down", T.Q5_K) == [0]  # i < n/8


def test_tied_embeddings_take_output_rule():
    types = choose_types(model(2, tied=True), "Q4_K_M", facts(2))
    assert "output.weight" not in types and types["token_embd.weight"] == T.Q6_K
    assert choose_types(model(2, tied=True), "Q8_0", facts(2))["token_embd.weight"] == T.Q8_0


def test_experts_and_70b():
    moe = choose_types(model(4), "Q4_K_M", facts(4, n_expert=8))
    assert layers_with(moe, "attn_v", T.Q8_0) == [0, 1, 2, 3] and layers_with(moe, "attn_k", T.Q8_0) == [0, 1, 2, 3]
    assert layers_with(moe, "attn_output", T.Q5_K) == [0, 1, 2, 3]
    big = choose_types(model(80, hidden=256, ffn=512, vocab=512), "Q3_K_S", facts(80))
    assert layers_with(big, "attn_v", T.Q5_K) == list(range(80))  # LLM_TYPE_70B bump


def test_single_row_weights_are_not_quantized():
    """tensor_allows_quantization judges ggml_n_dims: a [1, n] weight (Qwen's shared-expert gate) is 1-D there and
    llama-quantize keeps it as the converter wrote it: F32 where the converter forces F32, its output type else."""
    from quantkit.gguf.mixture import kept_as_converted, n_dims

    assert [n_dims(s) for s in [(256,), (1, 256), (256, 1), (4, 1, 256), (4, 256, 256)]] == [1, 1, 2, 3, 3]
    t = {**model(1, hidden=256, ffn=512, vocab=512), "blk.0.ffn_gate_inp_shexp.weight": (1, 256)}
    assert choose_types(t, "Q4_K_M", facts(1))["blk.0.ffn_gate_inp_shexp.weight"] == T.F32
    assert not kept_as_converted("blk.0.ffn_gate_inp_shexp.weight", (1, 256))
    assert kept_as_converted("blk.0.other.weight", (1, 256)) and not kept_as_converted("blk.0.other.weight", (2, 256))


def test_row_size_fallbacks():
    # one layer: use_more_bits(0, 1) holds, so Q4_K_M's attn_v is Q6_K -> Q8_0
    t = {"output.weight": (1000, 320), "token_embd.weight": (1000, 320),
         "blk.0.attn_v.weight": (320, 320), "blk.0.ffn_down.weight": (320, 48), "blk.0.attn_q.weight": (320, 320)}
    for ftype, expect in {
        "Q4_K_M": {"blk.0.attn_q.weight": T.Q5_0, "blk.0.attn_v.weight": T.Q8_0, "blk.0.ffn_down.weight": T.F16},
        "Q6_K": {"blk.0.attn_q.weight": T.Q8_0, "blk.0.ffn_down.weight": T.F16},
        "Q2_K": {"blk.0.attn_v.weight": T.Q4_0, "blk.0.attn_q.weight": T.Q4_0},
        "Q5_K_S": {"blk.0.attn_q.weight": T.Q5_1},
    }.items():
        types = choose_types(t, ftype, ModelFacts("llama", 1, 4, 4))
        assert types["output.weight"] == T.Q8_0  # ne[0] % 256 != 0 -> Q8_0
        for name, qtype in expect.items():
            assert types[name] == qtype, (ftype, name)


def test_file_type_names_and_aliases():
    from quantkit.errors import InputError

    assert file_type("q4_k")[0] == "Q4_K_M" and int(file_type("Q4_K_M")[1]) == 15
    assert file_type("iq4_xs")[1:] == (F.MOSTLY_IQ4_XS, T.IQ4_XS) and file_type("IQ2_S")[2] == T.IQ2_XS
    with pytest.raises(InputError) as info:
        file_type("IQ5_K")
    assert "Q4_K_M" in info.value.hint and "IQ2_XXS" in info.value.hint


IQ_MIXES = ["IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
            "IQ1_S", "IQ1_M"]


def test_iq4_mixes():
    gqa4 = choose_types(model(16), "IQ4_XS", facts(16))
    assert layers_with(gqa4, "attn_v", T.Q5_K) == list(range(16))  # n_gqa >= 4
    assert layers_with(gqa4, "ffn_down", T.Q5_K) == [0, 1]  # i < n/8 without an imatrix
    assert layers_with(choose_types(model(16), "IQ4_XS", facts(16), True), "ffn_down", T.Q5_K) == []
    mha = choose_types(model(16, n_head_kv=32), "IQ4_NL", facts(16, n_head_kv=32), True)
    assert type_counts(mha) == {"F32": 33, "IQ4_NL": 16 * 7 + 1, "Q6_K": 1}


def test_iq3_mixes():
    xxs = choose_types(model(16, n_head_kv=32), "IQ3_XXS", facts(16, n_head_kv=32), True)
    assert layers_with(xxs, "attn_q", T.IQ2_S) == layers_with(xxs, "attn_k", T.IQ2_S) == list(range(16))
    assert layers_with(xxs, "attn_v", T.IQ3_XXS) == list(range(16))  # with an imatrix; IQ3_S without
    assert layers_with(xxs, "attn_output", T.IQ3_S) == list(range(16))
    assert xxs["token_embd.weight"] == T.IQ3_S and xxs["output.weight"] == T.Q5_K
    plain = choose_types(model(16, n_head_kv=32), "IQ3_XXS", facts(16, n_head_kv=32))
    assert layers_with(plain, "ffn_down", T.Q4_K) == [0, 1] and layers_with(plain, "attn_v", T.IQ3_S) == list(range(16))
    xs = choose_types(model(16), "IQ3_XS", facts(16))
    assert layers_with(xs, "ffn_gate", T.IQ3_XXS) == layers_with(xs, "ffn_up", T.IQ3_XXS) == list(range(2, 14))
    assert layers_with(xs, "attn_v", T.Q4_K) == list(range(16)) and xs["output.weight"] == T.Q6_K
    m = choose_types(model(16), "IQ3_M", facts(16))
    assert layers_with(m, "ffn_down", T.Q4_K) == [0, 1] and layers_with(m, "attn_output", T.Q4_K) == list(range(16))


@pytest.mark.parametrize("ftype,low,attn_output", [("IQ2_XXS", T.Q2_K, T.IQ2_XXS), ("IQ2_M", T.IQ3_S, T.IQ3_S),
                                                   ("IQ1_M", T.Q2_K, T.IQ2_XXS)])
def test_low_iq_mixes(ftype, low, attn_output):
    types = choose_types(model(16, n_head_kv=32), ftype, facts(16, n_head_kv=32), True)
    base = file_type(ftype)[2]
    assert layers_with(types, "attn_v", low) == list(range(16))
    assert layers_with(types, "ffn_down", low) == [0, 1]
    assert layers_with(types, "ffn_down", base) == list(range(2, 16))
    assert layers_with(types, "attn_output", attn_output if ftype != "IQ2_XXS" else base) == list(range(16))
    assert types["output.weight"] == T.Q5_K
    assert types["token_embd.weight"] == (T.IQ3_S if ftype == "IQ2_M" else T.Q2_K)
    gqa = choose_types(model(16), ftype, facts(16), True)
    assert layers_with(gqa, "attn_v", T.Q4_K) == list(range(16))


def test_iq_fallbacks_on_rows_of_576():
    t = {"token_embd.weight": (1000, 576), "blk.0.attn_q.weight": (576, 576), "blk.0.ffn_down.weight": (576, 1536),
         "blk.0.ffn_up.weight": (1536, 576)}
    facts1 = ModelFacts("llama", 1, 9, 3)
    for ftype in ("IQ4_XS", "IQ3_S", "IQ2_XXS", "IQ1_S"):
        types = choose_types(t, ftype, facts1, True)
        assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == T.IQ4_NL, ftype
        assert types["token_embd.weight"] == T.Q8_0  # tied: the output rule, 576 % 256 != 0
    assert choose_types(t, "IQ4_XS", facts1, True)["blk.0.ffn_down.weight"] == T.IQ4_XS
    assert choose_types(t, "IQ4_NL", facts1, True)["blk.0.attn_q.weight"] == T.IQ4_NL


def test_imatrix_rule_and_missing_kernels():
    from quantkit.gguf.mixture import missing_kernels, needs_imatrix

    types = choose_types(model(8, n_head_kv=32), "IQ2_XXS", facts(8, n_head_kv=32))
    needing = needs_imatrix(types)
    assert "blk.3.attn_q.weight" in needing and "token_embd.weight" not in needing
    assert needs_imatrix(choose_types(model(8), "IQ3_S", facts(8))) == []
    assert needs_imatrix(choose_types(model(8), "IQ3_XXS", facts(8)))  # attn_q/attn_k: IQ2_S
    assert missing_kernels(types, (T.F32, T.Q2_K, T.Q5_K)) == ["IQ2_XXS"]


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S",
                                       "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q5_1"])
def test_types_match_llama_quantize(micro_f16, tmp_path, gguf_type):
    """llama-quantize's chosen types on quantkit's F16 GGUF == quantkit's choice."""
    import gguf

    from tests.gguf.helpers import convert_to, run_quantize

    f16, theirs = tmp_path / "f16.gguf", tmp_path / "theirs.gguf"
    result = convert_to(micro_f16, f16, "F16")
    run_quantize(f16, theirs, gguf_type)
    actual = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(theirs)).tensors}
    from quantkit.gguf.convert import plan_tensors
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(micro_f16)
    ours = {p.name: p.qtype.name for p in plan_tensors(info.config, info.tensors, gguf_type)}
    assert ours == actual and result.tensors == len(actual)




# ------------------------------------------- i-quant mixes against llama-quantize --dry-run (optional)

def build_llama(out, layers: int, hidden: int, inter: int, heads: int, kv: int, tied: bool):
    """A random-weight Llama checkpoint (the dry run reads only the shapes; no training needed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

    tokenizer = build_tokenizer(bundled_texts(), 512)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         head_dim=64, tie_word_embeddings=tied, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def dry_run_types(f16, gguf_type: str, imatrix=None) -> dict[str, str]:
    """{tensor: type name} from llama-quantize --dry-run's log lines."""
    import re
    import subprocess

    from tests.gguf.helpers import need_llama

    cmd = [str(need_llama("llama-quantize")), "--dry-run"] + (["--imatrix", str(imatrix)] if imatrix else [])
    run = subprocess.run(cmd + [str(f16), gguf_type, "1"], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    line = re.compile(r"\]\s+(\S+)\s+- \[.*?\], type =\s+(\w+), size =[^(\n]*(?:\((\w+)\))?")
    return {m.group(1): (m.group(3) or m.group(2)).upper() for m in line.finditer(run.stdout + run.stderr)}


@pytest.fixture(scope="module")
def dry_models(tmp_path_factory):
    """{name: (checkpoint, F16 GGUF, imatrix covering every quantized tensor)}: 16 layers with GQA 4, and 8
    layers of width 576 without GQA and with tied embeddings (the fallback types)."""
    import numpy as np

    from quantkit.gguf import imatrix as im
    from quantkit.gguf.convert import plan_tensors
    from quantkit.io.checkpoint import check_model_dir
    from tests.gguf.helpers import convert_to, need_llama

    need_llama("llama-quantize")
    root = tmp_path_factory.mktemp("dry")
    models = {}
    for name, shape in {"gqa16": (16, 256, 512, 4, 1, False), "mha576": (8, 576, 1536, 9, 9, True)}.items():
        ckpt = build_llama(root / name, *shape)
        f16 = root / f"{name}.gguf"
        convert_to(ckpt, f16, "F16")
        info = check_model_dir(ckpt)
        plans = [p for p in plan_tensors(info.config, info.tensors, "Q4_K_M") if p.qtype != T.F32]
        sums = {p.name: np.ones((1, p.shape[-1]), np.float32) for p in plans if p.name != "token_embd.weight"}
        imatrix = im.write(im.Imatrix(sums, {n: np.ones(1, np.float32) for n in sums}, ["ones"], 1, 128),
                           root / f"{name}-imatrix.gguf")
        models[name] = (ckpt, f16, imatrix)
    return models


@pytest.mark.slow
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", ["gqa16", "mha576"])
def test_iq_mixes_match_llama_quantize(dry_models, name, with_imatrix):
    """quantkit's types == llama-quantize's for every i-quant mix (dry run: the kernels are not needed)."""
    from quantkit.gguf.convert import plan_tensors
    from quantkit.io.checkpoint import check_model_dir

    ckpt, f16, imatrix = dry_models[name]
    info = check_model_dir(ckpt)
    for gguf_type in IQ_MIXES:
        theirs = dry_run_types(f16, gguf_type, imatrix if with_imatrix else None)
        ours = {p.name: p.qtype.name for p in plan_tensors(info.config, info.tensors, gguf_type, with_imatrix)}
        assert ours == theirs, gguf_type
