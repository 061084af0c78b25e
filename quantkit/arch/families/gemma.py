"""Gemma (GemmaForCausalLM), Gemma 2 (Gemma2ForCausalLM) and Gemma 3 (Gemma3ForCausalLM, and the language
model of Gemma3ForConditionalGeneration).

Gemma's RMSNorm scales by (1 + w): llama.cpp's converter stores w + 1 (`norm_shift`). Gemma 1 and 2 write
no output head (the tied embedding is the output); Gemma 3 trims the embedding rows beyond the tokenizer's
vocabulary. GGUF: llama.cpp conversion/gemma.py (GemmaModel, Gemma2Model, Gemma3Model).
"""

from __future__ import annotations

from quantkit.arch.families import text
from quantkit.arch.families.base import ConfigRules, Family, Gguf
from quantkit.arch.families.llama import LLAMA_LIKE, decoder_rows
from quantkit.errors import UnsupportedError

# ---------------------------------------------------------------- smoothing rows

# Gemma 2/3: the MLP input is pre_feedforward_layernorm (post_attention_layernorm normalizes
# the attention output before the residual add).
GEMMA2_ROWS = decoder_rows("pre_feedforward_layernorm")
# Gemma 3 normalizes q and k after projection (q_norm/k_norm); AWQ smoothing input_layernorm ->
# q/k/v was measured worse than round-to-nearest (llm-compressor issue #2522), so AWQ leaves it out.
GEMMA3_ROWS = decoder_rows("pre_feedforward_layernorm", awq_attention_norm=False)

# ---------------------------------------------------------------- config.json rules


def alternating_layers(hp: dict, kwargs: dict) -> None:
    """Gemma 2: every other layer a sliding-window one, the first included."""
    if hp["layer_types"] is None:
        hp["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                             for i in range(hp["num_hidden_layers"])]


def gemma3_layers(hp: dict, kwargs: dict) -> None:
    """Gemma 3: every sliding_window_pattern-th layer global (6 when config.json does not say)."""
    pattern = hp["_sliding_window_pattern"] = kwargs.get("sliding_window_pattern", 6)
    if hp["layer_types"] is None:
        hp["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                             for i in range(hp["num_hidden_layers"])]


def gemma3_rope(hp: dict, kwargs: dict, entry: dict) -> None:
    """Gemma3TextConfig.convert_rope_params_to_dict: one dictionary per layer type."""
    scaling = kwargs.pop("rope_scaling", None)
    rope = hp["rope_parameters"] or {"sliding_attention": {"rope_type": "default"},
                                     "full_attention": {"rope_type": "default"}}
    if scaling is not None:
        rope["full_attention"].update(scaling)
    if rope.get("full_attention") is None:
        rope["full_attention"] = {"rope_type": "default"}
    rope["full_attention"].setdefault("rope_theta", kwargs.pop("rope_theta", entry["default_theta"]["global"]))
    if rope.get("sliding_attention") is None:
        rope["sliding_attention"] = {"rope_type": "default"}
    rope["sliding_attention"].setdefault("rope_theta",
                                         kwargs.pop("rope_local_base_freq", entry["default_theta"]["local"]))
    hp["rope_parameters"] = rope
    text.standardize(hp, entry)


# ---------------------------------------------------------------- GGUF


def add_gemma_params(writer, hp: dict, ftype: int) -> None:
    """GemmaModel.set_gguf_parameters (it does not call TextModel's: no RoPE keys)."""
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"] if "num_key_value_heads" in hp else hp["num_attention_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_file_type(ftype)


def add_gemma2_params(writer, hp: dict, ftype: int) -> None:
    add_gemma_params(writer, hp, ftype)
    writer.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    writer.add_sliding_window(hp["sliding_window"])


GEMMA3_DEFAULTS = {"max_position_embeddings": 131072, "num_attention_heads": 8, "rms_norm_eps": 1e-6,
                   "head_dim": 256, "num_key_value_heads": 4}


def add_gemma3_params(writer, hp: dict, ftype: int) -> None:
    """Gemma3Model.set_gguf_parameters: TextModel's keys, Gemma 3's defaults for absent hyper-
    parameters (the converter writes those keys twice; each is written once here with the value
    the converter's overwrite leaves), the final softcap and the sliding window."""
    text.add_text_params(writer, {**GEMMA3_DEFAULTS, **hp}, ftype)
    if "rope_theta" not in text.full_rope(hp):
        writer.add_rope_freq_base(1_000_000.0)
    if hp.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hp["sliding_window"])


def refuse(arch: str, what: str, hint: str) -> None:
    raise UnsupportedError(f"GGUF conversion of {arch}: {what}", hint=hint)


def check_gemma3_layers(arch: str, hp: dict) -> None:
    """llama.cpp's Gemma 3 makes every 6th layer global, whatever layer_types say."""
    expected = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(hp.get("num_hidden_layers", 26))]
    if hp.get("layer_types") not in (None, expected):
        refuse(arch, "layer_types differ from llama.cpp's Gemma 3 pattern (every 6th layer global)",
               "sliding-window attention converts for Gemma 2, Gemma 3 and Phi-3 only")


def check_gemma3_attention(arch: str, hp: dict) -> None:
    """Gemma 3: llama.cpp scales queries by 1/sqrt(head_dim) (27B: 1/sqrt(hidden/heads))."""
    if hp.get("attn_logit_softcapping") is not None:
        refuse(arch, "attention logit softcapping", "Gemma 3 checkpoints have none")
    expected = (hp.get("hidden_size", 2304) // hp.get("num_attention_heads", 8)
                if hp.get("num_hidden_layers", 26) == 62 else hp.get("head_dim", 256))
    if hp.get("query_pre_attn_scalar", expected) != expected:
        refuse(arch, f"query_pre_attn_scalar {hp.get('query_pre_attn_scalar')} differs from llama.cpp's "
               f"attention scale (1/sqrt({expected}))", "use a checkpoint with query_pre_attn_scalar = head_dim")


GEMMA3_GGUF = Gguf("GEMMA3", add_gemma3_params, "gemma3", norm_shift=True, trims_vocab=True,
                   rope_types=("default", "linear"), windowed=True,
                   checks=(check_gemma3_layers, check_gemma3_attention))

GEMMA = Family("gemma", "GemmaForCausalLM", smoothing=LLAMA_LIKE,
               gguf={"GemmaForCausalLM": Gguf("GEMMA", add_gemma_params, "gemma", norm_shift=True,
                                              drops_lm_head=True, rope_types=("default",))},
               config=ConfigRules())
GEMMA2 = Family("gemma2", "Gemma2ForCausalLM", smoothing=GEMMA2_ROWS,
                gguf={"Gemma2ForCausalLM": Gguf("GEMMA2", add_gemma2_params, "gemma2", norm_shift=True,
                                                drops_lm_head=True, rope_types=("default",), windowed=True)},
                config=ConfigRules((alternating_layers,)))
MLX_SLIDING_PATTERN = 6  # mlx-lm 0.32's gemma3_text ModelArgs.sliding_window_pattern default


def check_mlx_layer_pattern(config: dict) -> None:
    """mlx-lm's gemma3_text makes layer i global where (i + 1) % sliding_window_pattern == 0 (the pattern quantkit
    writes from the first full-attention layer; mlx-lm's default without one) and reads the cache of layer
    pattern - 1 for the global mask: layer_types another way, or fewer layers than the pattern, would run otherwise
    or fail at the first forward (IndexError)."""
    kinds = config.get("layer_types") or []
    if not kinds:
        return
    pattern = kinds.index("full_attention") + 1 if "full_attention" in kinds else \
        int(config.get("sliding_window_pattern") or MLX_SLIDING_PATTERN)
    theirs = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(kinds))]
    if theirs != kinds or len(kinds) < pattern:
        raise UnsupportedError(f"mlx: Gemma 3's layer_types {kinds}: mlx-lm's gemma3_text makes a layer global "
                               f"where its number (from 1) is a multiple of the sliding pattern, {pattern} here, and "
                               f"needs at least {pattern} layers, so it would run this model otherwise (or fail at "
                               "its first forward)",
                               hint="use --method gguf (llama.cpp reads the layer kinds) or a compressed-tensors method")


GEMMA3 = Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3 (text)", smoothing=GEMMA3_ROWS,
                gguf={"Gemma3ForCausalLM": GEMMA3_GGUF, "Gemma3ForConditionalGeneration": GEMMA3_GGUF},
                mlx="gemma3_text", mlx_checks=(check_mlx_layer_pattern,),
                config=ConfigRules((gemma3_layers,), gemma3_rope))

FAMILIES = (GEMMA, GEMMA2, GEMMA3)
