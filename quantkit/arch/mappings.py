"""Smoothing mappings per architecture, as data: one table for AWQ and SmoothQuant, read from the families'
records (each family's `smoothing`: quantkit.arch.families).

model_type -> [Mapping(smooth layer, balance layers)], llm-compressor regex syntax (`re:` +
re.match). The smooth layer's output is the balance layers' input: a per-channel scale s
divides the smooth layer's output channels and multiplies the balance layers' input columns
(mathematically a no-op), chosen by AWQ to minimise the quantized block's output error, and by
SmoothQuant as s_j = max|X_j|^alpha / max|W_j|^(1-alpha).

- AWQ uses the rows marked `awq` (norm -> linears and linear -> linear).
- SmoothQuant uses the rows marked `smoothquant`: only rows whose smooth layer is a norm (o_proj's
  and down_proj's inputs are not a norm output, so they are never smoothed there), and for MoE
  models not the norm feeding the experts (one scale shared by every expert unbalances them;
  llm-compressor's Mixtral/Qwen-MoE convention, as TensorRT-LLM's).

Sources: llm-compressor 0.14 `modifiers/transform/awq/mappings.py` (default, Phi-3, MoE, Gemma2
and Gemma3 lists) and `modifiers/transform/smoothquant/utils.py` (default, Phi-3, Mixtral and
Qwen-MoE lists), and the model definitions in transformers 5. Offset norms (Gemma's x * (1 + w))
are converted by llm-compressor around calibration, so smoothing them is sound.

MoE (module names after transformers 5 loads the model and llm-compressor linearizes the
experts: `mlp.gate` router, `mlp.experts.N.{gate,up,down}_proj`, Mixtral's `block_sparse_moe`
renamed to `mlp`): the MLP norm's row balances the router together with the experts' gate/up
projections, so scaling the norm's output leaves the routing unchanged (llm-compressor's
`_moe_default_mappings`, used there for Qwen2-MoE/Qwen3-MoE; llm-compressor has no Mixtral AWQ
entry and would fall back to the dense rows, which leave the router uncompensated, so Mixtral
takes the MoE rows). Qwen2-MoE also feeds its shared expert and `shared_expert_gate` from that
norm: they are balance layers of the same row (llm-compressor's MoE list leaves them out, which
would scale the shared expert's input uncompensated).

VLMs: the rows of the text model (`text_config.model_type`) resolved inside the family's language
model component (`re:(.*\.)?language_model\..*q_proj$`), so a vision tower's own norms and
projections (Mllama's vision layers are named `input_layernorm`/`q_proj` too) are never smoothed.
Refused before work: towers found by look (where the language model sits is not known), Mllama-style
cross-attention layers (their k/v projections read image features, not the norm's output), and a
text model without a row.
"""

from __future__ import annotations

import re
from dataclasses import replace

from quantkit.arch.families import FAMILIES
from quantkit.arch.families.base import Mapping
from quantkit.errors import UnsupportedError

__all__ = ["Mapping", "SMOOTHING_MAPPINGS"]

# model_type -> its rows, from the family records (quantkit.arch.families: each family's `smoothing`)
SMOOTHING_MAPPINGS: dict[str, list[Mapping]] = {f.model_type: list(f.smoothing) for f in FAMILIES if f.smoothing}


def supported_model_types() -> list[str]:
    return sorted(SMOOTHING_MAPPINGS)


def awq_mappings(model_type: str) -> list[Mapping]:
    return [m for m in SMOOTHING_MAPPINGS[model_type] if m.awq]


def smoothquant_mappings(model_type: str) -> list[Mapping]:
    return [m for m in SMOOTHING_MAPPINGS[model_type] if m.smoothquant]


def inside(component: str, rows: list[Mapping]) -> list[Mapping]:
    """`rows` with every pattern resolved only under the module `component` (a VLM's language model)."""
    return under(re.escape(component), rows)


def under(modules: str, rows: list[Mapping]) -> list[Mapping]:
    """`rows` with every pattern resolved only under the modules whose names end with the regex `modules`."""
    prefix = rf"re:(.*\.)?{modules}\."

    def anchored(pattern: str) -> str:
        return prefix + pattern.removeprefix("re:")

    return [replace(row, smooth=anchored(row.smooth), balance=tuple(anchored(b) for b in row.balance))
            for row in rows]


def model_mappings(info, method: str) -> list[Mapping]:
    """Every row for this model (text model or VLM), or UnsupportedError before any work."""
    from quantkit.arch.vlm import FAMILIES

    towers = info.towers
    if not towers.components:
        return holding(rows_for(info.model_type, method), info.config)
    if towers.family is None:
        raise UnsupportedError(
            f"{method}: {info.architecture} has towers found by look ({', '.join(towers.unknown)}), so where "
            "its language model sits is not known and the smoothing mappings cannot be resolved inside it",
            hint="use gptq (W4A16) or fp8 for this model; its towers stay 16-bit either way")
    family = FAMILIES[towers.family]
    if family.cross_attention:
        raise UnsupportedError(
            f"{method}: {family.name} refused: its cross-attention layers' k/v projections read image "
            "features, not the norm's output, so the smoothing rows do not hold there",
            hint="use gptq (W4A16) or fp8 for this model")
    text_type = (info.config.get("text_config") or {}).get("model_type", "unknown")
    rows = rows_for(text_type, method, f" (the text model of {family.name})")
    return inside(family.language, holding(rows, info.config.get("text_config") or {}))


def holding(rows: list[Mapping], config: dict) -> list[Mapping]:
    """The rows that hold for this config.json (Mapping.when: Granite 4's norm row only in its dense hybrids), each
    resolved only in the decoder layers it holds in (Mapping.layers: Llama 4's MoE and dense MLP rows)."""
    held = []
    for row in rows:
        if row.when is not None and not row.when(config):
            continue
        layers = None if row.layers is None else row.layers(config)
        if layers is None:
            held.append(row)
        elif layers:
            held.extend(under(rf"layers\.({'|'.join(str(i) for i in layers)})", [row]))
    return held


def rows_for(model_type: str, method: str, what: str = "") -> list[Mapping]:
    if model_type not in SMOOTHING_MAPPINGS:
        raise UnsupportedError(
            f"{method} has no smoothing mappings for architecture '{model_type}'{what}",
            hint="supported model types: " + ", ".join(supported_model_types()) + "; or use gptq, which needs no mappings")
    return SMOOTHING_MAPPINGS[model_type]
