"""Synthetic mixture-of-experts checkpoints, written tensor by tensor: the tests' DeepSeek-V3- and Qwen3-MoE-shaped
models, and ones large enough to measure the model-free path's memory against.

A checkpoint is config.json (transformers' own config class of the family, so every default is the one
transformers and vLLM read), the toy byte-level BPE tokenizer (quantkit.toy) and random bfloat16 weights under the
names the family's released checkpoints use: per-expert projections `mlp.experts.<e>.{gate,up,down}_proj`, the
router `mlp.gate` (DeepSeek-V3 with its float32 `e_score_correction_bias`), DeepSeek-V3's multi-head latent
attention (q_a/q_b, kv_a_proj_with_mqa/kv_b with their norms), its `first_k_dense_replace` dense layers, shared
experts, and its multi-token-prediction layer after the decoder's (`model.layers.<num_hidden_layers>.`: enorm,
hnorm, eh_proj, shared_head, a decoder layer) when `num_nextn_predict_layers` is set. No model object is built:
each tensor is drawn from its own seeded generator and written at its offset (quantkit.io.shards), so a
checkpoint larger than memory can be written. tests/test_toy_moe.py checks the names and shapes against the
model transformers builds for the config.

    python -m quantkit.toy_moe {deepseek_v3,qwen3_moe} OUT [--preset tiny] [--experts N] [--layers N]
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class MoePreset:
    hidden_size: int = 256
    intermediate_size: int = 512  # dense layers (DeepSeek-V3's first_k_dense_replace)
    moe_intermediate_size: int = 128  # one expert; a multiple of 128 so fp8-block's blocks tile it
    experts: int = 4
    experts_per_token: int = 2
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2  # Qwen3-MoE (GQA)
    head_dim: int = 64
    dense_layers: int = 1  # DeepSeek-V3: first_k_dense_replace
    shared_experts: int = 1  # DeepSeek-V3: n_shared_experts
    q_lora_rank: int = 128  # DeepSeek-V3's MLA
    kv_lora_rank: int = 128
    rope_head_dim: int = 64
    mtp_layers: int = 1  # DeepSeek-V3: num_nextn_predict_layers (0: none stored)


PRESETS = {
    "tiny": MoePreset(),
    # large enough that one slab is a small part of the model (the memory measurement in docs/big-models.md)
    "wide": MoePreset(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, experts=32, layers=4,
                      heads=8, kv_heads=4, head_dim=128, q_lora_rank=512, kv_lora_rank=256),
}
KINDS = ("deepseek_v3", "qwen3_moe")
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SHARD_BYTES = 256 * 1024 * 1024


def family_config(kind: str, preset: MoePreset, vocab: int, ids: dict):
    """The transformers config of a synthetic checkpoint (ids: bos/eos/pad token ids)."""
    import transformers as tf

    p = preset
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(vocab_size=vocab, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                                 moe_intermediate_size=p.moe_intermediate_size, num_hidden_layers=p.layers,
                                 num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, head_dim=p.head_dim,
                                 num_experts=p.experts, num_experts_per_tok=p.experts_per_token, norm_topk_prob=True,
                                 tie_word_embeddings=False, max_position_embeddings=4096, dtype="bfloat16", **ids)
    if kind == "deepseek_v3":
        return tf.DeepseekV3Config(vocab_size=vocab, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                                   moe_intermediate_size=p.moe_intermediate_size, num_hidden_layers=p.layers,
                                   num_attention_heads=p.heads, num_key_value_heads=p.heads,
                                   n_routed_experts=p.experts, n_shared_experts=p.shared_experts,
                                   num_experts_per_tok=p.experts_per_token, first_k_dense_replace=p.dense_layers,
                                   n_group=2, topk_group=1, q_lora_rank=p.q_lora_rank, kv_lora_rank=p.kv_lora_rank,
                                   qk_nope_head_dim=p.head_dim, qk_rope_head_dim=p.rope_head_dim,
                                   v_head_dim=p.head_dim, num_nextn_predict_layers=p.mtp_layers,
                                   tie_word_embeddings=False, max_position_embeddings=4096, dtype="bfloat16", **ids)
    raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")


def qwen3_moe_tensors(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of a Qwen3-MoE checkpoint of config `c` (config.json's dict)."""
    hidden, heads, kv, head_dim = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    experts = c.get("num_experts") or c["num_local_experts"]
    tensors = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,),
               "lm_head.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                    p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
                    p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
                    p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                    p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        sparse = i not in (c.get("mlp_only_layers") or []) and (i + 1) % (c.get("decoder_sparse_step") or 1) == 0
        if sparse:
            tensors[p + "mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                tensors |= mlp_tensors(f"{p}mlp.experts.{e}.", hidden, c["moe_intermediate_size"])
        else:
            tensors |= mlp_tensors(f"{p}mlp.", hidden, c["intermediate_size"])
    return {name: ("BF16", shape) for name, shape in tensors.items()}


def mlp_tensors(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (intermediate, hidden), prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


def deepseek_v3_layer(c: dict, i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One DeepSeek-V3 decoder layer's tensors (MLA attention; a dense MLP below first_k_dense_replace, else the
    router, its correction bias, the routed and the shared experts)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
    p = f"model.layers.{i}."
    t = {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
         p + "self_attn.q_a_proj.weight": (q_rank, hidden), p + "self_attn.q_a_layernorm.weight": (q_rank,),
         p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
         p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, hidden),
         p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
         p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
         p + "self_attn.o_proj.weight": (hidden, heads * v)}
    found = {name: ("BF16", shape) for name, shape in t.items()}
    if i < c["first_k_dense_replace"]:
        return found | {n: ("BF16", s) for n, s in mlp_tensors(f"{p}mlp.", hidden, c["intermediate_size"]).items()}
    experts, moe = c["n_routed_experts"], c["moe_intermediate_size"]
    found[p + "mlp.gate.weight"] = ("BF16", (experts, hidden))
    found[p + "mlp.gate.e_score_correction_bias"] = ("F32", (experts,))  # float32, as DeepSeek-V3 ships it
    for e in range(experts):
        found |= {n: ("BF16", s) for n, s in mlp_tensors(f"{p}mlp.experts.{e}.", hidden, moe).items()}
    shared = moe * (c.get("n_shared_experts") or 0)
    if shared:
        found |= {n: ("BF16", s) for n, s in mlp_tensors(f"{p}mlp.shared_experts.", hidden, shared).items()}
    return found


def deepseek_v3_tensors(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of a DeepSeek-V3 checkpoint of config `c`, its MTP layers included."""
    hidden, vocab, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    found = {"model.embed_tokens.weight": ("BF16", (vocab, hidden)), "model.norm.weight": ("BF16", (hidden,)),
             "lm_head.weight": ("BF16", (vocab, hidden))}
    for i in range(layers):
        found |= deepseek_v3_layer(c, i)
    for i in range(layers, layers + int(c.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{i}."
        found |= deepseek_v3_layer(c, i)
        found |= {p + "enorm.weight": ("BF16", (hidden,)), p + "hnorm.weight": ("BF16", (hidden,)),
                  p + "eh_proj.weight": ("BF16", (hidden, 2 * hidden)),
                  p + "embed_tokens.weight": ("BF16", (vocab, hidden)),
                  p + "shared_head.norm.weight": ("BF16", (hidden,)),
                  p + "shared_head.head.weight": ("BF16", (vocab, hidden))}
    return found


TENSORS = {"deepseek_v3": deepseek_v3_tensors, "qwen3_moe": qwen3_moe_tensors}


def random_tensor(name: str, dtype: str, shape: tuple[int, ...], seed: int, rows: slice | None = None):
    """Rows `rows` of tensor `name` (all of it by default): normal values (scale 0.05; norm weights around 1) from a
    generator seeded by the name, `seed` and the first row, so a block of rows is drawn without the rest."""
    import torch

    from quantkit.io.safetensors import TORCH_DTYPES

    start, stop = (rows.start, rows.stop) if rows is not None else (0, shape[0] if shape else 1)
    row_size = 1
    for n in shape[1:]:
        row_size *= n
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{start}".encode()))
    values = torch.randn(((stop - start) * row_size,), generator=gen).reshape((stop - start, *shape[1:]) if shape
                                                                            else ())
    values = values * 0.3 + 1.0 if name.endswith("norm.weight") else values * 0.05
    return values.to(getattr(torch, TORCH_DTYPES[dtype])).contiguous()


def write_tensors(out: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], seed: int,
                  shard_bytes: int = SHARD_BYTES) -> None:
    """Every tensor into shards of about shard_bytes (with the index when there are several), a few MiB at a time."""
    from quantkit.io.safetensors import tensor_bytes
    from quantkit.io.shards import ShardWriter, TensorSpec, layout_shards, write_index

    specs = [[TensorSpec(name, dtype, tuple(shape))] for name, (dtype, shape) in tensors.items()]
    layouts = layout_shards(specs, shard_bytes)
    for layout in layouts:
        with ShardWriter(layout, out / layout.file) as writer:
            for spec in layout.specs.values():
                rows = spec.shape[0] if spec.shape else 1
                step = max(1, (8 << 20) // max(1, spec.nbytes // rows))
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    chunk = random_tensor(spec.name, spec.dtype, spec.shape, seed, slice(start, stop) if spec.shape
                                          else None)
                    writer.write(spec.name, tensor_bytes(chunk), start * (spec.nbytes // rows))
    write_index(out, layouts)


def build_moe(kind: str, out: str | Path, preset: str | MoePreset = "tiny", seed: int = 0,
              shard_bytes: int = SHARD_BYTES, **changes) -> Path:
    """Write a synthetic `kind` checkpoint (KINDS) into `out`; `changes` replace fields of the preset."""
    from quantkit.toy import build_tokenizer, bundled_texts

    chosen = replace(PRESETS[preset] if isinstance(preset, str) else preset, **changes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(bundled_texts(), 512)
    tokenizer.save_pretrained(out)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = family_config(kind, chosen, len(tokenizer), ids)
    config.architectures = [ARCHITECTURES[kind]]
    config.save_pretrained(out)
    write_tensors(out, TENSORS[kind](json.loads((out / "config.json").read_text())), seed, shard_bytes)
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m quantkit.toy_moe KIND OUT [--preset tiny] [--experts N] [--layers N]`: write a synthetic MoE
    checkpoint."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m quantkit.toy_moe", description=main.__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    changes = {k: v for k, v in (("experts", args.experts), ("layers", args.layers)) if v is not None}
    out = build_moe(args.kind, args.out, args.preset, args.seed, **changes)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"built a {args.kind} checkpoint ({args.preset}) at {out}: {size / 2**20:.1f} MiB of weights",
          file=sys.stderr)


if __name__ == "__main__":
    main()
