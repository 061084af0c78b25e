"""SmolLM3 (SmolLM3ForCausalLM): a Llama decoder whose every 4th layer has no rotary embedding (NoPE).

config.json's `no_rope_layers` (1: the layer rotates q/k, 0: a NoPE layer; transformers derives it from
`no_rope_layer_interval`, 4 by default). GGUF: llama.cpp conversion/llama.py's SmolLM3Model (LlamaModel's
keys, q/k permutation and vocabulary; it writes no NoPE key): llama.cpp's smollm3 model fixes the NoPE layers
itself (n_no_rope_layer_step = 4: layer il skips RoPE where (il + 1) % 4 == 0), so a checkpoint whose
no_rope_layers say otherwise is refused, as are what its graph never loads (attention / MLP biases, Llama
3.1's rope_freqs). mlx-lm's smollm3 model reads no_rope_layers as transformers does.
"""

from __future__ import annotations

from dataclasses import replace

from quantkit.arch.families.base import Family
from quantkit.arch.families.llama import LLAMA_GGUF, LLAMA_LIKE
from quantkit.errors import UnsupportedError

LLAMA_CPP_NOPE_STEP = 4  # llama.cpp src/models/smollm3.cpp: hparams.n_no_rope_layer_step = 4


def no_rope_layers(hp: dict) -> list[int]:
    """SmolLM3Config.__post_init__: the per-layer RoPE flags, from no_rope_layer_interval where absent."""
    if hp.get("no_rope_layers") is not None:
        return list(hp["no_rope_layers"])[:hp["num_hidden_layers"]]
    interval = hp.get("no_rope_layer_interval") or 4
    return [int((i + 1) % interval != 0) for i in range(hp["num_hidden_layers"])]


def llama_cpp_rope_layers(n_layer: int) -> list[int]:
    return [int((i + 1) % LLAMA_CPP_NOPE_STEP != 0) for i in range(n_layer)]


def check_nope_layers(arch: str, hp: dict) -> None:
    """llama.cpp's smollm3 graph skips RoPE on every 4th layer whatever the file says (the converter writes no
    key for it): another layout would convert into a model that rotates the wrong layers."""
    if no_rope_layers(hp) != llama_cpp_rope_layers(hp["num_hidden_layers"]):
        raise UnsupportedError(
            f"GGUF conversion of {arch}: no_rope_layers {no_rope_layers(hp)} differ from llama.cpp's smollm3 "
            f"(a NoPE layer every {LLAMA_CPP_NOPE_STEP}th layer, fixed in its graph; the converter writes no key "
            "for it)", hint="SmolLM3 checkpoints use no_rope_layer_interval 4; use a compressed-tensors method "
                            "or mlx for this one")


def check_no_biases(arch: str, hp: dict) -> None:
    """llama.cpp's smollm3 model loads no attention output or MLP bias: the converter's file would not load."""
    for key in ("attention_bias", "mlp_bias"):
        if hp.get(key):
            raise UnsupportedError(f"GGUF conversion of {arch}: {key} = true (llama.cpp's smollm3 model loads "
                                   "no attention output / MLP bias; it refuses such a file)",
                                   hint="SmolLM3 checkpoints have none; use a compressed-tensors method for this one")


SMOLLM3_GGUF = replace(LLAMA_GGUF, arch="SMOLLM3",
                       # llama3's rope_freqs tensor: llama.cpp's smollm3 model never loads it
                       rope_types=("default", "linear", "yarn"), checks=(check_nope_layers, check_no_biases))

SMOLLM3 = Family(
    "smollm3", "SmolLM3ForCausalLM", "SmolLM3",
    smoothing=LLAMA_LIKE,
    gguf={"SmolLM3ForCausalLM": SMOLLM3_GGUF},
    mlx="smollm3",
)

FAMILIES = (SMOLLM3,)
