"""Linear layers vLLM runs as one: q/k/v as `qkv_proj`, gate/up as `gate_up_proj`, the q_a/kv_a projections
of multi-head latent attention as `fused_qkv_a_proj`.

vLLM's models declare these groups (`packed_modules_mapping`: Llama, Mistral, Qwen2/3, Gemma 1/2/3 and
the language models of the VLMs built on them; DeepSeek-V2/V3 for MLA) and load each group's shards into
one fused Linear (a routed expert's gate/up go into the fused experts' w13 alike). A
compressed-tensors checkpoint must then give every shard of a group the same scheme: all quantized
alike or all kept 16-bit. vLLM 0.32 refuses anything else at load time ("Found different quantization
schemes for the shards of ... vLLM requires all to use the same scheme",
model_executor/layers/quantization/compressed_tensors/utils.py should_ignore_layer). Checkpoints that
store the fused layer itself (Phi-3's qkv_proj and gate_up_proj) have nothing to group.
"""

from __future__ import annotations

from collections.abc import Iterable

FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                # DeepSeek-V2/V3's multi-head latent attention: vLLM's DeepseekV2ForCausalLM (packed_modules_mapping)
                "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
SHARD_GROUP = {shard: fused for fused, shards in FUSED_SHARDS.items() for shard in shards}


def partners(name: str) -> tuple[str, list[str]] | None:
    """(the fused layer's name, the other shards' names) of a shard such as `model.layers.0.self_attn.k_proj`;
    None for a layer vLLM does not fuse."""
    parent, _, leaf = name.rpartition(".")
    fused = SHARD_GROUP.get(leaf)
    if fused is None:
        return None
    prefix = f"{parent}." if parent else ""
    return prefix + fused, [prefix + shard for shard in FUSED_SHARDS[fused] if shard != leaf]


def split_groups(kept: Iterable[str], layers: Iterable[str]) -> dict[str, str]:
    """The layers of `layers` that must join `kept` so that no fused group is split: partner -> why."""
    kept, present, joined = set(kept), set(layers), {}
    for name in sorted(kept & present):
        found = partners(name)
        if found is None:
            continue
        fused, others = found
        for other in others:
            if other in present and other not in kept and other not in joined:
                joined[other] = f"vLLM fuses it with {name} into {fused}, which is kept 16-bit"
    return joined
