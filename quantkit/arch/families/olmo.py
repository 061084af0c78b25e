"""OLMo 2 (Olmo2ForCausalLM) and OLMo 3 (Olmo3ForCausalLM): post-norm decoder blocks (the block's attention and
MLP outputs are normalised before the residual add: post_attention_layernorm, post_feedforward_layernorm; the
attention and MLP read the residual stream itself), q/k RMSNorms over the whole q / k projection (not per head),
and for OLMo 3 sliding-window layers (every 4th layer global, by `layer_types`).

Smoothing: no norm's output feeds only the q/k/v or gate/up projections, so there is no norm row: SmoothQuant
(norm rows only) is refused with that reason; AWQ keeps the linear -> linear rows (v_proj -> o_proj: v is not
normalised; up_proj -> down_proj).

GGUF: llama.cpp conversion/olmo.py's Olmo2Model (TextModel's keys and vocabulary, q/k not permuted: llama.cpp's
olmo2 uses NeoX RoPE; where the config has a sliding_window, the window and the per-layer pattern from
layer_types). llama.cpp's olmo2 model always loads an output head and no attention output bias; its sliding
layers rotate with plain RoPE (no scaling). mlx-lm: olmo2, olmo3 (one rope_theta for both layer kinds).
"""

from __future__ import annotations

from quantkit.arch.families import text
from quantkit.arch.families.base import Family, Gguf, Mapping
from quantkit.errors import UnsupportedError

OLMO_ROWS = (
    Mapping("re:.*v_proj$", ("re:.*o_proj$",), smoothquant=False),
    Mapping("re:.*up_proj$", ("re:.*down_proj$",), smoothquant=False),
)
OLMO_SMOOTHQUANT = ("OLMo's norms are post-norms (post_attention_layernorm / post_feedforward_layernorm normalise "
                    "a block's output before the residual add, q_norm / k_norm the whole q / k projection): no "
                    "norm's output feeds only the q/k/v or gate/up projections, so SmoothQuant has no norm to "
                    "smooth into them")


# ---------------------------------------------------------------- GGUF


def sliding_pattern(hp: dict) -> list[bool]:
    """Olmo2Model.set_gguf_parameters: sliding per layer from layer_types, else every layer but each 4th."""
    if "layer_types" in hp:
        return [t == "sliding_attention" for t in hp["layer_types"]]
    return [(i + 1) % 4 != 0 for i in range(hp["num_hidden_layers"])]


def add_olmo2_params(writer, hp: dict, ftype: int) -> None:
    """Olmo2Model.set_gguf_parameters: TextModel's, then the window and its per-layer pattern where the config
    has a sliding_window key (OLMo 3)."""
    text.add_text_params(writer, hp, ftype)
    if "sliding_window" in hp:
        writer.add_sliding_window(hp["sliding_window"])
        writer.add_sliding_window_pattern(sliding_pattern(hp))


def refuse(arch: str, what: str, hint: str) -> None:
    raise UnsupportedError(f"GGUF conversion of {arch}: {what}", hint=hint)


def check_output_head(arch: str, hp: dict) -> None:
    """llama.cpp's olmo2 model requires output.weight: a checkpoint with tied embeddings has none to write."""
    if hp.get("tie_word_embeddings"):
        refuse(arch, "tie_word_embeddings = true (llama.cpp's olmo2 model requires an output head, which a "
               "checkpoint with tied embeddings does not store; the converter's file fails to load)",
               "OLMo 2 / 3 checkpoints have their own lm_head; use a compressed-tensors method for this one")


def check_no_attention_bias(arch: str, hp: dict) -> None:
    if hp.get("attention_bias"):
        refuse(arch, "attention_bias = true (llama.cpp's olmo2 model loads no attention output bias; the "
               "converter's file fails to load)", "OLMo checkpoints have none; use a compressed-tensors method")


def check_full_width_heads(arch: str, hp: dict) -> None:
    """llama.cpp's olmo2 model sizes q and its norm by hidden_size (n_embd) and the head by hidden / heads."""
    if hp.get("head_dim") not in (None, hp["hidden_size"] // hp["num_attention_heads"]):
        refuse(arch, f"head_dim {hp['head_dim']} differs from hidden_size / num_attention_heads (llama.cpp's olmo2 "
               "model sizes the heads by hidden_size)", "OLMo checkpoints have head_dim = hidden / heads")


OLMO2_GGUF = Gguf("OLMO2", add_olmo2_params, "gpt2", windowed=True,
                  checks=(check_output_head, check_no_attention_bias, check_full_width_heads))


# ---------------------------------------------------------------- MLX


def check_mlx_rope(config: dict) -> None:
    """mlx-lm's olmo3 rotates both layer kinds with one rope_theta, and quantkit writes mlx-lm a rope_scaling
    only for llama3 / longrope (quantkit.mlx.checkpoint): another scaling would be read as none."""
    rope = config.get("rope_parameters") or {}
    full, local = (rope.get("full_attention"), rope.get("sliding_attention")) if "full_attention" in rope \
        else (rope, rope)
    full, local = full or {}, local or {}
    if full.get("rope_type", "default") != "default":
        raise UnsupportedError(f"mlx: RoPE type '{full['rope_type']}' on OLMo's full-attention layers: quantkit "
                               "writes mlx-lm no rope_scaling for it, so mlx-lm would rotate them unscaled",
                               hint="use --method gguf (llama.cpp converts it) or a compressed-tensors method")
    if local.get("rope_theta", full.get("rope_theta")) != full.get("rope_theta"):
        raise UnsupportedError("mlx: OLMo's sliding-window layers have their own rope_theta "
                               f"({local.get('rope_theta')} vs {full.get('rope_theta')}): mlx-lm's olmo3 rotates "
                               "every layer with one rope_theta", hint="use --method gguf or a compressed-tensors method")


OLMO2 = Family("olmo2", "Olmo2ForCausalLM", "OLMo 2", smoothing=OLMO_ROWS, gguf={"Olmo2ForCausalLM": OLMO2_GGUF},
               mlx="olmo2", smoothquant_refusal=OLMO_SMOOTHQUANT, mlx_checks=(check_mlx_rope,))
OLMO3 = Family("olmo3", "Olmo3ForCausalLM", "OLMo 3", smoothing=OLMO_ROWS, gguf={"Olmo3ForCausalLM": OLMO2_GGUF},
               mlx="olmo3", smoothquant_refusal=OLMO_SMOOTHQUANT, mlx_checks=(check_mlx_rope,))

FAMILIES = (OLMO2, OLMO3)
