"""The precision plan: which module gets which precision.

Every weight tensor is classified into a role (decoder, lm_head, embeddings, vision encoder,
projector, norm, other) by quantkit.arch.roles. A method then says what precision
each role gets. Vision encoders and projectors of VLMs stay in 16-bit by rule, whatever the
method; lm_head stays unquantized by default for the compressed-tensors methods.

The plan works from checkpoint tensor names (safetensors headers), so `quantkit inspect`
needs no torch. Patterns are unanchored so they match both checkpoint names and the module
names transformers v5 gives VLMs after loading (`model.vision_tower...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantkit.arch.roles import KEEP_16BIT_ROLES, TOWER_EMBEDDING, classify, linear_weights, matches
from quantkit.io.checkpoint import ModelInfo

if TYPE_CHECKING:
    from quantkit.methods import MethodSpec


@dataclass
class PlanEntry:
    name: str  # module name (tensor name without .weight)
    role: str
    shape: list[int]
    precision: str  # e.g. "fp8-e4m3 W/channel A/token", or "bf16 (kept: lm_head)"
    kept: bool  # True: the weight stays in the model's 16-bit dtype

    @property
    def params(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def tower_precision_text(precision: str, forced: bool) -> str:
    granularity = "W/channel" if precision == "int8" else "W/group"
    return f"{precision} {granularity} sym RTN (tower{', forced' if forced else ''})"


def build_plan(info: ModelInfo, method: MethodSpec, options, ignore: list[str],
               towers: dict[str, str] | None = None) -> list[PlanEntry]:
    """One entry per linear weight with the precision the method will give it, experts stored fused across experts
    one entry per expert projection (quantkit.arch.moe.fused_expert_linears), kept 16-bit where the method does not
    quantize them (Layers.quantizes_fused_experts); `towers` maps the tower roles a target quantizes to their
    precision (int8/int4), {} keeps every tower 16-bit."""
    from quantkit.arch.moe import fused_expert_linears

    exact_types = method.layers.exact_types(info, options)
    fused = {name: shape for name, (_tensor, shape) in fused_expert_linears(info.config, info.tensors).items()}
    keeps_fused = bool(fused) and not method.layers.quantizes_fused_experts(info, options)

    def chosen(name: str, shape: list[int]) -> str | None:
        if keeps_fused and name in fused:
            return None
        return exact_types.get(name) or method.precision(classify(name + ".weight", info.towers), options, name, shape)

    return [plan_entry(info, name, shape, chosen(name, shape), ignore, towers or {})
            for name, shape in (linear_weights(info) | fused).items()]


def plan_entry(info: ModelInfo, name: str, shape: list[int], chosen: str | None, ignore: list[str],
               towers: dict[str, str] | None = None) -> PlanEntry:
    """The entry for one weight: the method's choice, unless a rule or the ignore list keeps it 16-bit."""
    role = classify(name + ".weight", info.towers)
    kept_dtype = info.dtype.lower()
    if role in (towers or {}) and not TOWER_EMBEDDING.search(name):
        return PlanEntry(name, role, shape, tower_precision_text(towers[role], towers[role] == "int4"), False)
    if role == "tower":
        return PlanEntry(name, role, shape, f"{kept_dtype} (kept: unknown tower stays 16-bit)", True)
    if role in KEEP_16BIT_ROLES:
        return PlanEntry(name, role, shape, f"{kept_dtype} (kept: {role} stays 16-bit)", True)
    if not chosen:
        return PlanEntry(name, role, shape, f"{kept_dtype} (kept: {role})", True)
    if matches(name, ignore):
        return PlanEntry(name, role, shape, f"{kept_dtype} (kept: ignore pattern)", True)
    return PlanEntry(name, role, shape, chosen, False)


def role_summary(entries: list[PlanEntry]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for entry in entries:
        row = summary.setdefault(entry.role, {"modules": 0, "params": 0, "precisions": {}})
        row["modules"] += 1
        row["params"] += entry.params
        row["precisions"][entry.precision] = row["precisions"].get(entry.precision, 0) + 1
    return summary


def kv_cache_bytes(config: dict, context: int = 4096, batch: int = 1, bytes_per_value: int = 2) -> int:
    """K and V for `context` tokens x `batch` sequences: 2 * layers * kv_heads * head_dim * bytes * tokens
    (a VLM's language model; an absent or null key takes transformers' default: KV heads = heads)."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
    return 2 * (text.get("num_hidden_layers") or 0) * kv_heads * head_dim * bytes_per_value * context * batch


MEMORY_NOTE = (
    "weights as `quantkit plan` sizes each method's default artifact; with overhead = (weights + fp16 KV cache "
    "for {context} tokens, batch 1) x 1.10 for activations and buffers"
)
