"""Hunyuan dense (HunYuanDenseV1ForCausalLM): a Llama-style decoder with RMS norms on the rotated queries and keys
(`query_layernorm` / `key_layernorm`) and dynamic NTK RoPE scaled by `alpha` (transformers' HunYuanDenseV1
rotary: base = rope_theta * alpha ** (head_dim / (head_dim - 2)), at every length up to the configured context).

GGUF: llama.cpp conversion/hunyuan.py's HunYuanModel: TextModel's keys (without an expert count), and for dynamic
RoPE the alpha-scaled base as the frequency base, no scaling (type none, factor 1), a 256K context and original
context; the converter asserts rope_theta 10000 and a configured context of 32K or 256K (refused otherwise, as
it fails), and assumes alpha 50 where the config has none, which transformers does not apply (refused). Its
vocabulary from tokenizer.json (TextModel's BPE, merges), the end-of-sequence id replaced by `eod_token_id`, an
end-of-turn id from generation_config.json's first eos id where it lists several; a checkpoint without
tokenizer.json (the hy.tiktoken vocabulary, read by the converter only through the checkpoint's own remote
tokenizer code) is refused.

mlx-lm's hunyuan_v1_dense reads the alpha from a top-level `rope_scaling` {alpha, factor, type} (transformers 5
nests it in rope_parameters): written there, or mlx-lm would rotate with the unscaled base.

Hunyuan MoE (HunYuanMoEV1ForCausalLM): the same attention, then routed experts stored one tensor per expert
projection (`mlp.experts.<e>.{gate,up,down}_proj`, each `intermediate_size` wide in transformers' model) beside a
shared MLP (`mlp.shared_mlp`) and a softmax router whose Linear is `mlp.gate.wg` (kept 16-bit, quantkit.arch.roles).
The llm-compressor methods calibrate every expert on every token. A config.json whose `moe_intermediate_size`
is not `intermediate_size` (or is a per-layer list) is refused before work: llm-compressor's linear experts take
their width from it, transformers' experts from intermediate_size.

GGUF of Hunyuan MoE is refused before work (MOE_GGUF_REFUSAL). llama.cpp's HunYuanMoEModel (hunyuan_moe: routed
experts stacked into ffn_*_exps, the shared MLP as ffn_*_shexp, `mlp.gate.wg` as ffn_gate_inp) reads its vocabulary
only through the checkpoint's own tiktoken tokenizer code (AutoTokenizer with trust_remote_code, its
`mergeable_ranks` and `special_tokens`), which quantkit does not run; on transformers' own tokenizer
(tokenizer.json) it fails ("TokenizersBackend has no attribute mergeable_ranks"). Its set_gguf_parameters reads
the remote-code config.json's per-layer lists `moe_intermediate_size`, `moe_topk` and `num_shared_expert`, and on
a config as transformers 5 writes it (a `moe_topk` number, no moe_intermediate_size) fails first
(KeyError 'moe_intermediate_size'). So no checkpoint quantkit reads converts there.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.arch.families import text
from quantkit.arch.families.base import ExpertCheckpoint, Family, Gguf, MoeLayout
from quantkit.arch.families.llama import LLAMA_LIKE, ROUTED_ROWS
from quantkit.errors import ModelError, UnsupportedError

ARCH = "HunYuanDenseV1ForCausalLM"
LONG_CONTEXT = 256 * 1024  # the converter's context for dynamic RoPE


def scaled_base(rope: dict, head_dim: int) -> float:
    """HunYuanModel.set_gguf_parameters' (and transformers' rotary) NTK-alpha base, in Python floats as both."""
    alpha, base = rope.get("alpha", 50), rope.get("rope_theta", 10000.0)
    return base * (alpha ** (head_dim / (head_dim - 2)))


def add_hunyuan_params(writer, hp: dict, ftype: int) -> None:
    """HunYuanModel.set_gguf_parameters: TextModel's keys without num_experts, then dynamic RoPE as a plain RoPE of
    the alpha-scaled base over a 256K context (the keys the converter writes twice are written once, with the
    value its second write leaves)."""
    import gguf

    rope = text.full_rope(hp)
    dynamic = rope.get("rope_type") == "dynamic"
    params = {k: v for k, v in hp.items() if k != "num_experts"}
    if dynamic:
        params["max_position_embeddings"] = LONG_CONTEXT
        params["rope_parameters"] = {**rope, "rope_theta": scaled_base(rope, hp["head_dim"])}
        params.pop("rope_scaling", None)
    text.add_text_params(writer, params, ftype)
    if dynamic:
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1)
        writer.add_rope_scaling_orig_ctx_len(LONG_CONTEXT)


def check_dynamic_rope(arch: str, hp: dict) -> None:
    """What the converter asserts (or assumes) of a dynamic RoPE."""
    rope = text.full_rope(hp)
    if rope.get("rope_type") != "dynamic":
        return
    hint = "Hunyuan dense checkpoints state alpha, rope_theta 10000 and max_position_embeddings 32768"
    if rope.get("alpha") is None:
        raise UnsupportedError(f"GGUF conversion of {arch}: dynamic RoPE without alpha (llama.cpp's converter then "
                               "assumes alpha 50, which transformers does not apply)", hint=hint)
    if rope.get("rope_theta", 10000.0) != 10000.0 or hp.get("max_position_embeddings") not in (32768, LONG_CONTEXT):
        raise UnsupportedError(f"GGUF conversion of {arch}: dynamic RoPE with rope_theta {rope.get('rope_theta')} "
                               f"and max_position_embeddings {hp.get('max_position_embeddings')} (llama.cpp's "
                               "converter asserts rope_theta 10000 and a context of 32768 or 262144)", hint=hint)
    if not hp.get("head_dim"):
        raise UnsupportedError(f"GGUF conversion of {arch}: dynamic RoPE without head_dim (llama.cpp's converter "
                               "scales the base by head_dim)", hint="state head_dim in config.json")


def check_tokenizer_json(model_dir: Path, hp: dict) -> None:
    """HunYuanModel.set_vocab reads tokenizer.json; without it, only the checkpoint's remote tiktoken code."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        found = sorted(p.name for p in model_dir.glob("*.tiktoken"))
        raise UnsupportedError(f"GGUF conversion of {ARCH}: no tokenizer.json in {model_dir}"
                               + (f" ({', '.join(found)} only)" if found else "")
                               + " (llama.cpp's converter reads a Hunyuan tiktoken vocabulary only through the "
                                 "checkpoint's own tokenizer code, which quantkit does not run)",
                               hint="use a checkpoint that ships tokenizer.json, or llama.cpp's convert_hf_to_gguf.py "
                                    "for this one")
    if (hp.get("pad_token_id") or 0) < 0:
        raise UnsupportedError(f"GGUF conversion of {ARCH}: pad_token_id {hp.get('pad_token_id')} (llama.cpp's "
                               "converter then writes the special ids without a pad id; not reproduced)",
                               hint="set pad_token_id to a token id (or null) in config.json")


def mlx_rope_scaling(config: dict) -> dict:
    """mlx-lm's hunyuan_v1_dense reads alpha from a top-level rope_scaling with alpha, factor and type."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "dynamic" or rope.get("alpha") is None:
        return {}
    return {"rope_scaling": {"alpha": rope["alpha"], "factor": rope.get("factor", 1.0), "type": "dynamic"}}


HUNYUAN_DENSE = Family(
    "hunyuan_v1_dense", ARCH, "Hunyuan",
    smoothing=LLAMA_LIKE,
    gguf={ARCH: Gguf("HUNYUAN_DENSE", add_hunyuan_params, "hunyuan", rope_types=("default", "dynamic"),
                     checks=(check_dynamic_rope,), vocab_check=check_tokenizer_json,
                     own_names=True)},
    mlx="hunyuan_v1_dense",
    mlx_fields=mlx_rope_scaling,
)

def check_expert_width(info) -> None:
    """The experts' width llm-compressor's linear experts read (moe_intermediate_size, where config.json has it)
    is the one transformers builds them with (intermediate_size)."""
    config = info.config.get("text_config") or info.config
    width, built = config.get("moe_intermediate_size"), config.get("intermediate_size")
    if width is not None and width != built:
        raise ModelError(f"{info.path / 'config.json'}: moe_intermediate_size = {width} but transformers' Hunyuan "
                         f"MoE builds its experts intermediate_size = {built} wide (llm-compressor would "
                         "linearize them at the other width)",
                         hint=f"where every expert is {built} wide, remove moe_intermediate_size from config.json")


MOE_GGUF_REFUSAL = ("llama.cpp's converter (HunYuanMoEModel) reads the vocabulary only through the checkpoint's own "
                    "tiktoken tokenizer code (its mergeable_ranks), which quantkit does not run, and fails on "
                    "transformers' tokenizer.json one (no mergeable_ranks); it also fails on a config.json without "
                    "the per-layer lists moe_intermediate_size, moe_topk and num_shared_expert (as transformers 5 "
                    "writes it)")

HUNYUAN_MOE = Family("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", "Hunyuan MoE", smoothing=ROUTED_ROWS, moe=MoeLayout(),
                     experts_by_name=ExpertCheckpoint(), checks=(check_expert_width,), gguf_refusal=MOE_GGUF_REFUSAL,
                     mlx_refusal="mlx-lm 0.32 has no model for model_type hunyuan_v1_moe (its hunyuan model reads "
                                 "the remote-code checkpoints' fused qkv_proj and gate_and_up_proj)")

FAMILIES = (HUNYUAN_DENSE, HUNYUAN_MOE)
