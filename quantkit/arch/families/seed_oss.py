"""Seed-OSS (SeedOssForCausalLM): a Llama-style decoder with q/k/v biases. GGUF: llama.cpp conversion/olmo.py's
SeedOssModel (TextModel's keys and vocabulary, nothing else); llama.cpp's seed_oss graph has no attention output
bias, so a checkpoint with one (`attention_out_bias`, which Seed-OSS-36B does not set) is refused."""

from __future__ import annotations

from quantkit.arch.families import text
from quantkit.arch.families.base import Family, Gguf
from quantkit.arch.families.llama import LLAMA_LIKE
from quantkit.errors import UnsupportedError


def check_no_output_bias(arch: str, hp: dict) -> None:
    if hp.get("attention_out_bias"):
        raise UnsupportedError(f"GGUF conversion of {arch}: attention_out_bias = true (llama.cpp's seed_oss "
                               "model has no attention output bias; it refuses such a file)",
                               hint="Seed-OSS checkpoints have none; use a compressed-tensors method for this one")


SEED_OSS = Family(
    "seed_oss", "SeedOssForCausalLM", "Seed-OSS",
    smoothing=LLAMA_LIKE,
    gguf={"SeedOssForCausalLM": Gguf("SEED_OSS", text.add_text_params, "gpt2", checks=(check_no_output_bias,))},
    mlx="seed_oss",
)

FAMILIES = (SEED_OSS,)
