"""The role of every weight, from its name: decoder, lm_head, embeddings, norm, router, a VLM
tower (quantkit.arch.vlm), other; and llm-compressor's name-matching rule for ignore lists.

The rules work on checkpoint tensor names (safetensors headers), so they need no torch. Patterns
are unanchored so they match both checkpoint names and the module names transformers v5 gives
VLMs after loading (`model.vision_tower...`).
"""

from __future__ import annotations

import re

from quantkit.arch.vlm import FAMILIES, TOWER_ROLES, Towers, family_towers

# MoE routers: the linear that scores the experts (Mixtral `block_sparse_moe.gate`, Qwen-MoE
# `mlp.gate`, transformers 5's `mlp.router`) and Qwen2-MoE's `shared_expert_gate`. Tiny, and their
# top-k choice is discontinuous: rounding them changes which experts run. Kept 16-bit by every
# compressed-tensors method and nf4 (no method's precision() quantizes the "router" role, and the
# ignore list names them); gguf keeps llama.cpp's own type for them (its mixture rules).
ROUTER_NAMES = r"(block_sparse_moe|mlp)\.(gate|router)|shared_expert_gate"
# Routers that are a Linear inside the router module: Hunyuan-MoE's `mlp.gate.wg`, Granite-MoE's
# `block_sparse_moe.router.layer`, and Llama 4's `feed_forward.router`. A second pattern, so the ignore list of the
# families above keeps its text.
INNER_ROUTER_NAMES = r"mlp\.gate\.wg|block_sparse_moe\.router\.layer|feed_forward\.router"


# Role rules after the towers (quantkit.arch.vlm), checked in order; first match wins.
ROLE_RULES: list[tuple[str, str]] = [
    ("lm_head", r"(^|\.)(lm_head|embed_out)\.weight$"),
    ("router", rf"(^|\.)({ROUTER_NAMES}|{INNER_ROUTER_NAMES})\.weight$"),
    ("embeddings", r"(^|\.)(embed_tokens|embed_tokens_per_layer|wte|wpe|word_embeddings|embed_positions|tok_embeddings)"
                   r"\.weight$"),
    ("norm", r"(norm|ln_\d|ln_f|layernorm)[^.]*\.(weight|bias)$"),
    ("decoder", r"(^|\.)(layers|h|blocks|block)\.\d+\."),
]


# Every known family's towers at once: the rule for a name seen without its model.
GENERIC_TOWERS = Towers(tuple(dict.fromkeys(pair for role in ("projector", "audio", "vision") for model_type in FAMILIES
                                            for pair in family_towers(model_type).components if pair[0] == role)))


# Roles never quantized, whatever the method: every VLM tower (quantkit.arch.vlm.TOWER_ROLES).
KEEP_16BIT_ROLES = TOWER_ROLES


ROUTER_PATTERN = rf"re:.*\.({ROUTER_NAMES})$"
INNER_ROUTER_PATTERN = rf"re:.*\.({INNER_ROUTER_NAMES})$"


def classify(tensor_name: str, towers: Towers | None = None) -> str:
    """The role of a tensor (or module) name: a tower of `towers` (the model's, `info.towers`;
    without it, the towers of every known VLM family), else by the name rules."""
    role = (GENERIC_TOWERS if towers is None else towers).role(tensor_name)
    if role:
        return role
    for role, pattern in ROLE_RULES:
        if re.search(pattern, tensor_name):
            return role
    return "other"


def linear_weights(info) -> dict[str, list[int]]:
    """2-D `.weight` tensors that are linear layers (embeddings and lm_head included, for the plan), from
    a checkpoint's headers (`info`: quantkit.io.checkpoint.ModelInfo)."""
    return {
        name[: -len(".weight")]: shape
        for name, (_dtype, shape) in info.tensors.items()
        if name.endswith(".weight") and len(shape) == 2
    }


def matches(name: str, patterns: list[str]) -> bool:
    """llm-compressor semantics: `re:` = re.match on the name; otherwise exact name or last component."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


# A tower quantized on request (a target's `vision`/`projector`): round-to-nearest, weights only,
# symmetric; int8 per output channel, int4 in groups of the largest of these dividing every input width.
TOWER_BITS = {"int8": 8, "int4": 4}


TOWER_GROUP_SIZES = (128, 64, 32, 16)


# 2-D tower weights that are not linear layers (position and patch embeddings) stay 16-bit.
TOWER_EMBEDDING = re.compile(r"embed")
