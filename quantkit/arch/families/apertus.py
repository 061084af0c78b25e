"""Apertus (ApertusForCausalLM): a Llama-style decoder with q/k norms, Llama 3.1 RoPE, norms named
`attention_layernorm` / `feedforward_layernorm`, and an ungated MLP (up_proj -> xIELU -> down_proj) whose xIELU
activation has learned per-layer parameters (`mlp.act_fn.alpha_p` / `alpha_n`, buffers `beta` / `eps`).

Smoothing: the attention norm -> q/k/v, v -> o and the MLP norm -> up_proj rows. No up_proj -> down_proj row:
dividing up_proj's output channels by s and multiplying down_proj's input columns by s is exact only through an
activation with act(x / s) = act(x) / s, and xIELU (quadratic for x > 0, an exponential below) is not, so AWQ
leaves that row out (a gated MLP's gate keeps the product linear in up_proj's output; Apertus has no gate).

GGUF: llama.cpp conversion/llama.py's ApertusModel: LlamaModel's keys, vocabulary and Llama 3.1 rope_freqs, without
its q/k permutation (llama.cpp's apertus graph rotates as transformers does), and the xIELU parameters written as
the metadata arrays xielu.alpha_p / alpha_n / beta / eps (one float per layer, the stored values), not as tensors.

mlx-lm's apertus model requires mlp_bias, post_norm and qk_norm in config.json, which transformers' ApertusConfig
does not have: written as transformers' Apertus is built (no MLP bias, no post-norm, q/k norms).
"""

from __future__ import annotations

from quantkit.arch.families.base import Family, Gguf, Mapping, MetadataTensor
from quantkit.arch.families.llama import LLAMA_ROPE, QKV, add_llama_params, llama_extra_tensors

APERTUS_ROWS = (
    Mapping("re:.*attention_layernorm$", QKV, smoothquant=True),
    Mapping("re:.*v_proj$", ("re:.*o_proj$",), smoothquant=False),
    Mapping("re:.*feedforward_layernorm$", ("re:.*up_proj$",), smoothquant=True),
    # no up_proj -> down_proj row: xIELU between them is not homogeneous (see the module docstring)
)

XIELU = tuple(MetadataTensor(f"mlp.act_fn.{name}", f"xielu.{name}", shape)
              for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())))


def mlx_apertus_fields(config: dict) -> dict:
    """What mlx-lm's apertus ModelArgs require and transformers' ApertusConfig lacks."""
    return {"mlp_bias": False, "post_norm": False, "qk_norm": True}


APERTUS = Family(
    "apertus", "ApertusForCausalLM", "Apertus",
    smoothing=APERTUS_ROWS,
    gguf={"ApertusForCausalLM": Gguf("APERTUS", add_llama_params, "llama", rope_types=LLAMA_ROPE,
                                     strips_text_model=True, extra_tensors=llama_extra_tensors,
                                     metadata_tensors=XIELU, own_names=True)},
    mlx="apertus",
    mlx_fields=mlx_apertus_fields,
)

FAMILIES = (APERTUS,)
