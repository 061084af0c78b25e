"""Where a transformers causal LM keeps its parts, for the forwards quantkit runs itself (the gate, the imatrix,
the calibration statistics): the decoder, its layers and final norm without the head."""

from __future__ import annotations


def decoder(model):
    """The model's decoder: transformers' get_decoder(), or the causal LM's `model` where that lookup gives the
    causal LM itself (Llama4ForCausalLM, whose base_model_prefix "language_model" names no attribute of it)."""
    found = model.get_decoder()
    inner = getattr(model, "model", None)
    return inner if found is model and inner is not None and hasattr(inner, "layers") else found
