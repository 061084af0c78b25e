"""Mistral (MistralForCausalLM), Mixtral (MixtralForCausalLM) and the language model of Mistral 3 (Small
3.1) VLMs: llama.cpp converts all three with LlamaModel (conversion/llama.py; Mistral3 as MISTRAL3).

Mixtral's experts are stored per expert as `block_sparse_moe.experts.N.w1/w2/w3`; transformers 5 loads them
fused under `mlp`, and llm-compressor's linear experts are named `gate_proj`/`up_proj`/`down_proj`.
"""

from __future__ import annotations

from dataclasses import replace

from quantkit.arch.families import text
from quantkit.arch.families.base import ConfigRules, Family, MoeLayout
from quantkit.arch.families.llama import LLAMA_GGUF, LLAMA_LIKE, MOE_ROWS

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
)

FAMILIES = (MISTRAL, MIXTRAL)
