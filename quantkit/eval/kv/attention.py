"""A KV type applied inside the transformers model's attention, through transformers' attention interface.

The wrapper registered with ``AttentionInterface.register`` (transformers' public extension point: no third-party
code is patched) receives each layer's query, keys and values after RoPE, shaped (batch, heads, positions,
head_dim) with the keys and values per KV head (before repeat_kv), replaces them by what the engine's cache holds
(``KvType.key`` / ``value`` / ``query``) and calls the model's own attention function on them. Layers the type
skips run unchanged; for a type whose first prefill chunk attends over raw keys and values (vLLM's TurboQuant),
the positions before ``prefill`` read the raw ones and the later positions (the decode steps of a served request)
read the cache, every earlier position included.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from quantkit.eval.kv import KvType


def attention_configs(model) -> list:
    """The distinct configs the model's attention modules read _attn_implementation from."""
    seen = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention") and hasattr(module, "config"):
            seen[id(module.config)] = module.config
    return list(seen.values())


def own_attention(module, implementation: str):
    """The attention function a module would call for `implementation` (eager: its modeling file's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def simulated(kind: KvType, query, key, value):
    """(query, key, value) as the engine's attention reads them."""
    q = kind.query(query) if kind.query is not None else query
    return q, kind.key(key), kind.value(value)


def kv_attention(kind: KvType, implementation: str, prefill: int):
    """The wrapper for one KV type over the model's attention `implementation`."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        base = own_attention(module, implementation)
        if getattr(module, "layer_idx", None) in kind.skip:
            return base(module, query, key, value, attention_mask, **kwargs)
        q, k, v = simulated(kind, query, key, value)
        out, weights = base(module, q, k, v, attention_mask, **kwargs)
        if kind.raw_prefill and prefill > 0:
            raw, _ = base(module, query, key, value, attention_mask, **kwargs)
            out = out.clone()
            out[:, :prefill] = raw[:, :prefill]  # attention output: (batch, positions, heads, head_dim)
        return out, weights

    return attention


@contextmanager
def registered(kind: KvType, implementation: str, prefill: int = 0):
    """The KV type's attention function registered with transformers' AttentionInterface while inside; yields
    the name a config's _attn_implementation selects it by."""
    from transformers import AttentionInterface

    name = f"quantkit_kv_{id(kind):x}"
    AttentionInterface.register(name, kv_attention(kind, implementation, prefill))
    try:
        yield name
    finally:
        AttentionInterface._global_mapping.pop(name, None)


@contextmanager
def kv_cache(model, kind: KvType | None, prefill: int = 0):
    """While inside, the model's attention reads keys and values through `kind` (None: unchanged)."""
    if kind is None:
        yield model
        return
    configs = attention_configs(model)
    before = [c._attn_implementation for c in configs]
    with registered(kind, before[0] if before else "sdpa", prefill) as name:
        try:
            for config in configs:
                config._attn_implementation = name
            yield model
        finally:
            for config, impl in zip(configs, before):
                config._attn_implementation = impl
