"""Ministral 3 (Ministral3ForCausalLM): a Mistral decoder with YaRN RoPE and Llama 4's attention temperature
(queries scaled by 1 + beta * log(1 + floor(position / original_max_position_embeddings)), beta being
rope_parameters' `llama_4_scaling_beta`; 1 below the original context).

GGUF: llama.cpp conversion/mistral3.py's Ministral3Model (a LlamaModel: q/k permuted, LlamaModel's keys and
vocabulary, TextModel's YaRN keys) writing `rope.scaling.yarn_log_multiplier` = mscale_all_dim and
`attention.temperature_scale` = llama_4_scaling_beta; llama.cpp's mistral3 model takes the temperature's floor
scale from the YaRN original context, as transformers does. The converter asserts a YaRN rope_parameters for
ministral3 and reads both keys: a checkpoint without them is refused before work.

vLLM (its registry maps Ministral3ForCausalLM to MistralForCausalLM) reads the temperature only from a
top-level `llama_4_scaling` (Mistral's own params.json format), not from the Hugging Face config's
rope_parameters: it serves the HF checkpoint without it, which changes nothing below original_max_position_
embeddings (16384 in Ministral 3's configs) and differs beyond. mlx-lm's ministral3 reads rope_parameters
itself (YaRN and the temperature).
"""

from __future__ import annotations

from dataclasses import replace

from quantkit.arch.families import text
from quantkit.arch.families.base import Family
from quantkit.arch.families.llama import LLAMA_GGUF, LLAMA_LIKE, add_llama_params
from quantkit.errors import UnsupportedError

CONVERTER_KEYS = ("mscale_all_dim", "llama_4_scaling_beta")


def add_ministral3_params(writer, hp: dict, ftype: int) -> None:
    """Ministral3Model.set_gguf_parameters: LlamaModel's, then the YaRN log multiplier and the temperature."""
    add_llama_params(writer, hp, ftype)
    rope = text.rope_parameters(hp)
    writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def check_yarn(arch: str, hp: dict) -> None:
    """The converter asserts rope_type 'yarn' for ministral3 and reads mscale_all_dim and llama_4_scaling_beta."""
    rope = text.rope_parameters(hp)
    if rope.get("rope_type") != "yarn":
        raise UnsupportedError(f"GGUF conversion of {arch}: RoPE type '{rope.get('rope_type')}' (llama.cpp's "
                               "converter takes ministral3 with a YaRN rope_parameters only)",
                               hint="Ministral 3 checkpoints use YaRN; use a compressed-tensors method for this one")
    missing = [key for key in CONVERTER_KEYS if rope.get(key) is None]
    if missing:
        raise UnsupportedError(f"GGUF conversion of {arch}: rope_parameters lack {', '.join(missing)} (llama.cpp's "
                               "converter writes them as the YaRN log multiplier and the attention temperature)",
                               hint="Ministral 3 checkpoints state both; use a compressed-tensors method for this one")


MINISTRAL3_GGUF = replace(LLAMA_GGUF, arch="MISTRAL3", params=add_ministral3_params, rope_types=("yarn",),
                          checks=(check_yarn,))

MINISTRAL3 = Family(
    "ministral3", "Ministral3ForCausalLM", "Ministral 3",
    smoothing=LLAMA_LIKE,
    gguf={"Ministral3ForCausalLM": MINISTRAL3_GGUF},
    mlx="ministral3",
)

FAMILIES = (MINISTRAL3,)
