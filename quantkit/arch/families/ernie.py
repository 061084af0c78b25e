"""ERNIE 4.5 dense (Ernie4_5ForCausalLM): a Llama-style decoder with interleaved (GLM-style) RoPE and, by default,
tied embeddings. GGUF: llama.cpp conversion/ernie.py's Ernie4_5Model (TextModel's keys; no q/k permutation: its
ernie4_5 graph rotates interleaved pairs, as transformers does), whose vocabulary is the SentencePiece
tokenizer.model alone (`_set_vocab_sentencepiece`, then add_prefix_space from tokenizer_config.json): a checkpoint
without one is refused, as the converter fails on it. llama.cpp's ernie4_5 model loads no feed-forward biases, so
a checkpoint with `use_bias` is refused for GGUF (the file would not load).

ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM): the same attention, MoE layers from `moe_layer_start_index` every
`moe_layer_interval` layers, routed experts stored one tensor per expert projection beside shared experts
(`mlp.shared_experts`), a softmax router (`mlp.gate`, kept 16-bit) whose correction bias is stored as
`mlp.moe_statics.e_score_correction_bias` (transformers moves it under the router: quantkit's reading renames it
as transformers does, quantkit.arch.moe.load_renamings). The llm-compressor methods calibrate every expert on
every token. No GGUF conversion yet.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.arch.families import text
from quantkit.arch.families.base import ExpertCheckpoint, Family, Gguf, MoeLayout
from quantkit.arch.families.llama import LLAMA_LIKE
from quantkit.errors import UnsupportedError

ARCH = "Ernie4_5ForCausalLM"


def check_no_bias(arch: str, hp: dict) -> None:
    if hp.get("use_bias"):
        raise UnsupportedError(f"GGUF conversion of {arch}: use_bias = true (llama.cpp's ernie4_5 model loads no "
                               "feed-forward biases; the converter writes them and the file fails to load)",
                               hint="ERNIE 4.5 checkpoints have none; use a compressed-tensors method or mlx for "
                                    "this one")


def check_tokenizer_model(model_dir: Path, hp: dict) -> None:
    """Ernie4_5Model.set_vocab reads tokenizer.model only (its _set_vocab_sentencepiece fails without one)."""
    if not (Path(model_dir) / "tokenizer.model").is_file():
        raise UnsupportedError(f"GGUF conversion of {ARCH}: no tokenizer.model in {model_dir} (llama.cpp's converter "
                               "reads ERNIE 4.5's vocabulary only from its SentencePiece tokenizer.model)",
                               hint="copy tokenizer.model from the original ERNIE 4.5 checkpoint into the model "
                                    "directory")


ERNIE4_5 = Family(
    "ernie4_5", ARCH, "ERNIE 4.5",
    smoothing=LLAMA_LIKE,
    gguf={ARCH: Gguf("ERNIE4_5", text.add_text_params, "ernie4_5", checks=(check_no_bias,),
                     vocab_check=check_tokenizer_model)},
    mlx="ernie4_5",
)

ERNIE4_5_MOE = Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "ERNIE 4.5 MoE", moe=MoeLayout(),
                      experts_by_name=ExpertCheckpoint())

FAMILIES = (ERNIE4_5, ERNIE4_5_MOE)
