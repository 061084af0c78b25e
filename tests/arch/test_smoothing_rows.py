"""Every family's smoothing rows (AWQ's and SmoothQuant's) preserve the model's function before quantization: a
random per-channel scale divided out of each smooth layer and multiplied into its balance layers, inside
llm-compressor's offset-norm context (Gemma's norms scale by 1 + w), leaves the logits of a tiny random model of
the family as they were, at float32 rounding. A row that forgets a layer the smooth layer feeds does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from quantkit.arch.families import by_model_type
from tests.families import common
from tests.gguf.families import build_family

# tests/gguf/families.py's tiny families (Gemma 3: offset norms, q/k norms, pre- and post-feedforward norms;
# Phi-3: fused qkv and gate_up) -> their model_type; Gemma and Gemma 2 (offset norms) are built here.
BUILT = {"llama31": "llama", "mistral": "mistral", "qwen25": "qwen2", "gemma3": "gemma3_text", "phi3": "phi3"}
GEMMAS = {"gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 64}),
          "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64, "query_pre_attn_scalar": 64,
                                                           "sliding_window": 32})}


def tiny(name, tmp_path):
    if name in GEMMAS:
        config_class, model_class, extra = GEMMAS[name]
        return common.build(tmp_path / name, config_class, model_class, **extra), name
    return build_family(name, tmp_path / name), BUILT[name]


@pytest.mark.parametrize("name", [*BUILT, *GEMMAS])
def test_smoothing_rows_preserve_the_function(name, tmp_path):
    model, model_type = tiny(name, tmp_path)
    rows = by_model_type(model_type).smoothing
    assert rows
    assert common.smoothed_kld(model, rows) < 1e-6  # float32 rounding (scales up to 10x); a wrong row: > 1e-4


def test_a_row_missing_a_balance_layer_breaks_the_function(tmp_path):
    """The check can fail: Gemma 3's feed-forward norm row without up_proj scales gate_proj's input alone."""
    model, model_type = tiny("gemma3", tmp_path)
    row = next(r for r in by_model_type(model_type).smoothing if "pre_feedforward" in r.smooth)
    assert common.smoothed_kld(model, [replace(row, balance=row.balance[:1])]) > 1e-4


def offset_norm_model(name, tmp_path):
    if name == "qwen35":
        from tests.families.test_qwen35 import build

        return build(tmp_path / name), "qwen3_5_text"
    return tiny(name, tmp_path)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3", "qwen35"])
def test_offset_norms_smooth_through_bf16_at_bf16_rounding(name, tmp_path):
    """In the checkpoint's bf16 and with scales as wide as AWQ's search picks on spiky channels (1e-3 to 1e3), the
    offset norms (x * (1 + w)) smooth as a plain norm does: the KL divergence is bf16's rounding of the balance
    layers (a Llama of this size: 8.6e-5; measured here 1.5e-5 to 2.1e-4). llm-compressor 0.14.0.1 alone stores
    (1 + w) / s - 1 in bf16, which loses the small factors of the large scales (measured 0.006 to 0.083)."""
    model, model_type = offset_norm_model(name, tmp_path)
    rows = by_model_type(model_type).smoothing
    exact = common.smoothed_kld(model, rows, low=1e-3, high=1e3, dtype="bfloat16")
    alone = common.smoothed_kld(model, rows, low=1e-3, high=1e3, dtype="bfloat16", exact_offsets=False)
    assert exact < 3e-4 and alone > 20 * exact
