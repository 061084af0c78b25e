"""Mistral (MistralForCausalLM), Mixtral (MixtralForCausalLM) and the language model of Mistral 3 (Small
3.1) VLMs: llama.cpp converts all three with LlamaModel (conversion/llama.py; Mistral3 as MISTRAL3).

Mixtral's experts are stored per expert as `block_sparse_moe.experts.N.w1/w2/w3`; transformers 5 loads them
fused under `mlp`, and llm-compressor's linear experts are named `gate_proj`/`up_proj`/`down_proj`.

MLX: mlx-lm's mixtral stacks them as `block_sparse_moe.switch_mlp.gate_proj/up_proj/down_proj` (w1, w3, w2); it
takes each head's width as hidden_size / num_attention_heads and attends without a sliding window, so a config.json
saying otherwise is refused.
"""

from __future__ import annotations

from dataclasses import replace

from quantkit.arch.families import text
from quantkit.arch.families.base import ConfigRules, Family, MlxExperts, MoeLayout
from quantkit.arch.families.llama import LLAMA_GGUF, LLAMA_LIKE, MOE_ROWS
from quantkit.errors import UnsupportedError


def check_mlx_mixtral(config: dict) -> None:
    """mlx-lm's mixtral: heads of hidden_size / num_attention_heads, no sliding window."""
    head_dim, width = config.get("head_dim"), config["hidden_size"] // config["num_attention_heads"]
    if head_dim is not None and head_dim != width:
        raise UnsupportedError(f"mlx: Mixtral with head_dim {head_dim}: mlx-lm's mixtral takes each head's width as "
                               f"hidden_size / num_attention_heads ({width})",
                               hint="use --method gguf for llama.cpp on Apple silicon")
    if config.get("sliding_window") is not None:
        raise UnsupportedError(f"mlx: Mixtral with sliding_window {config['sliding_window']}: mlx-lm's mixtral "
                               "attends to every position", hint="use --method gguf for llama.cpp on Apple silicon")

MISTRAL = Family(
    "mistral", "MistralForCausalLM", "Mistral",
    smoothing=LLAMA_LIKE,
    gguf={"MistralForCausalLM": LLAMA_GGUF,
          # Mistral3: ministral3 and mistral4 text models take other converter classes
          "Mistral3ForConditionalGeneration": replace(LLAMA_GGUF, arch="MISTRAL3", text_types=("mistral",))},
    mlx="llama",
    config=ConfigRules((text.head_dim, text.kv_heads)),
)

MIXTRAL = Family(
    "mixtral", "MixtralForCausalLM", "Mixtral",
    smoothing=MOE_ROWS,
    moe=MoeLayout(expert_names={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
                  block_rename=("block_sparse_moe", "mlp")),
    gguf={"MixtralForCausalLM": replace(LLAMA_GGUF, experts="mixtral")},
    config=ConfigRules((text.kv_heads,)),
    mlx="mixtral", mlx_experts=MlxExperts({"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
    mlx_checks=(check_mlx_mixtral,),
)

FAMILIES = (MISTRAL, MIXTRAL)
