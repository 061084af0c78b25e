"""Where a transformers causal LM keeps its parts, for the forwards quantkit runs itself (the gate, the imatrix,
the calibration statistics): the decoder, its layers and final norm without the head, and what its forward does to
the head's logits."""

from __future__ import annotations


def decoder(model):
    """The model's decoder: transformers' get_decoder(), or the causal LM's `model` where that lookup gives the
    causal LM itself (Llama4ForCausalLM, whose base_model_prefix "language_model" names no attribute of it)."""
    found = model.get_decoder()
    inner = getattr(model, "model", None)
    return inner if found is model and inner is not None and hasattr(inner, "layers") else found


# model_type -> how its CausalLM's forward applies config.logits_scaling to the head's logits (transformers 5.17):
# Granite's divide them (MiniCPM3 divides the hidden states before a head without bias: the same logits), HyperCLOVA
# X multiplies them
LOGITS_SCALING = {"granite": "divide", "granite_swa": "divide", "granitemoe": "divide", "granitemoe_swa": "divide",
                  "granitemoeshared": "divide", "granitemoehybrid": "divide", "minicpm3": "divide",
                  "hyperclovax": "multiply"}


def logits_scale(text_config: dict) -> tuple[str, float] | None:
    """("divide" | "multiply", config.logits_scaling) where the model's forward scales its logits so; None."""
    how, value = LOGITS_SCALING.get(text_config.get("model_type", "")), text_config.get("logits_scaling")
    return (how, float(value)) if how is not None and value not in (None, 1, 1.0) else None
