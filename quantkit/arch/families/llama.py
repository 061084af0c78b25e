"""Llama 2 / 3.x (LlamaForCausalLM), and the language model of the VLMs llama.cpp converts as Llama (LLaVA,
SmolVLM's VLlama3). The Llama decoder layer's smoothing rows are shared by the families built like it.

GGUF: LlamaModel (llama.cpp conversion/llama.py): q/k rows permuted from Hugging Face's rotate_half layout
to interleaved pairs, the vocabulary size and RoPE dimension count written, Llama 3.1's RoPE factors as the
generated `rope_freqs` tensor.
"""

from __future__ import annotations

import numpy as np

from quantkit.arch.families import text
from quantkit.arch.families.base import ConfigRules, Family, Gguf, Mapping

# ---------------------------------------------------------------- smoothing rows of a Llama-style decoder layer

QKV = ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$")
GATE_UP = ("re:.*gate_proj$", "re:.*up_proj$")


def decoder_rows(mlp_norm: str, awq_attention_norm: bool = True, mlp_balance: tuple[str, ...] = GATE_UP,
                 smoothquant_mlp: bool = True) -> tuple[Mapping, ...]:
    """The four rows of a Llama-style decoder layer; `mlp_norm` is the norm feeding the MLP,
    `mlp_balance` the layers it feeds."""
    return (
        Mapping("re:.*input_layernorm$", QKV, smoothquant=True, awq=awq_attention_norm),
        Mapping("re:.*v_proj$", ("re:.*o_proj$",), smoothquant=False),
        Mapping(f"re:.*{mlp_norm}$", mlp_balance, smoothquant=smoothquant_mlp),
        Mapping("re:.*up_proj$", ("re:.*down_proj$",), smoothquant=False),
    )


LLAMA_LIKE = decoder_rows("post_attention_layernorm")
# MoE (module names after transformers 5 loads the model and llm-compressor linearizes the experts): the norm
# feeding the experts balances the router with their gate/up projections, so scaling its output leaves the
# routing unchanged; SmoothQuant leaves that norm out (quantkit.arch.mappings)
MOE_GATE_UP = ("re:.*mlp.gate$", "re:.*mlp.experts.*.gate_proj$", "re:.*mlp.experts.*.up_proj$")
MOE_ROWS = decoder_rows("post_attention_layernorm", mlp_balance=MOE_GATE_UP, smoothquant_mlp=False)
# MoE families whose router is a weight parameter, no Linear (DeepSeek-V3, GLM-4.5, ERNIE 4.5 MoE, MiniMax-M2), or a
# float32 Linear inside it (Hunyuan MoE): the norm feeding the experts cannot be smoothed without changing the
# routing, and llm-compressor resolves a row in every layer or fails, so the MLP norm has no row (the first dense
# layers' included); each expert's up -> down row holds
ROUTED_ROWS = tuple(row for row in LLAMA_LIKE if "post_attention_layernorm" not in row.smooth)

# ---------------------------------------------------------------- GGUF

LLAMA_ROPE = ("default", "linear", "yarn", "llama3")


def add_llama_params(writer, hp: dict, ftype: int) -> None:
    """LlamaModel.set_gguf_parameters: TextModel's + vocab_size and the RoPE dimension count."""
    text.add_text_params(writer, hp, ftype)
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_rope_dimension_count(text.head_dim_of(hp))


def llama3_rope_factors(hp: dict, rope: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors, computed with torch in float32 as the converter does
    (numpy's float32 pow may differ from torch's in the last bit)."""
    import math

    import torch

    base = rope.get("rope_theta", 10000.0)
    dim = text.head_dim_of(hp)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def llama_extra_tensors(hp: dict) -> dict[str, np.ndarray]:
    """LlamaModel.generate_extra_tensors: `rope_freqs` for Llama 3.1's RoPE."""
    rope = text.full_rope(hp)
    if (rope.get("rope_type") or "").lower() == "llama3":
        return {"rope_freqs.weight": llama3_rope_factors(hp, rope)}
    return {}


LLAMA_GGUF = Gguf("LLAMA", add_llama_params, "llama", permute_qk=True, rope_types=LLAMA_ROPE,
                  strips_text_model=True, extra_tensors=llama_extra_tensors)

LLAMA = Family(
    "llama", "LlamaForCausalLM", "Llama 3.1 / 3.2 / 3.3",
    smoothing=LLAMA_LIKE,
    # VLMs: convert_hf_to_gguf.py converts their language model (LlamaModel for Llava; SmolVLM's
    # text_config.architectures, through which the converter converts an Idefics3 / SmolVLM language model)
    gguf={"LlamaForCausalLM": LLAMA_GGUF, "LlavaForConditionalGeneration": LLAMA_GGUF,
          "VLlama3ForCausalLM": LLAMA_GGUF},
    mlx="llama",
    config=ConfigRules((text.head_dim, text.kv_heads)),
)

FAMILIES = (LLAMA,)
