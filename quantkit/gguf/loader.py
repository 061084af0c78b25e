"""GGUF -> Hugging Face state dict (float32 torch tensors), for evaluating a .gguf in transformers.

Every tensor is dequantized with gguf-py, its GGUF name mapped back to the HF name through the
same TensorNameMap the converter uses (inverted over the HF names this architecture has), and
each conversion step undone: the llama Q/K row permutation, Gemma's norm shift (w - 1), stacked
experts turned into transformers' in-memory expert tensors (mlp.experts.gate_up_proj = gate and
up concatenated per expert, mlp.experts.down_proj; the router is mlp.gate), Gemma 3's trimmed embedding rows restored (zero;
they are ids no tokenizer produces), a missing output taken from the tied embedding. Generated
tensors (rope_freqs, LongRoPE factors) have no HF counterpart and are skipped. Phi-3's fused
qkv_proj / gate_up_proj are fused in HF too. A VLM's language model gets the VLM's names
(`model.language_model.*`); its towers are not in the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from quantkit.errors import ModelError
from quantkit.gguf.convert import arch_spec, name_map, norm_shift, permute_heads, text_hparams, unpermute

# HF tensor names of the supported decoders ({i}: layer). Names absent from a checkpoint are ignored.
HF_GLOBAL = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
HF_LAYER = [
    "model.layers.{i}.input_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight",
    "model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.o_proj.weight",
    "model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
    "model.layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.o_proj.bias",
    "model.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight",
    "model.layers.{i}.block_sparse_moe.gate.weight", "model.layers.{i}.mlp.gate.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight", "model.layers.{i}.post_feedforward_layernorm.weight",
]
HF_LAYER_FUSED = ["model.layers.{i}.self_attn.qkv_proj.weight", "model.layers.{i}.mlp.gate_up_proj.weight"]
GENERATED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# HF prefix of the language model inside a VLM (the converter strips "language_model.")
LANGUAGE_MODEL_PREFIX = {"Gemma3ForConditionalGeneration": "model.language_model."}
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def hf_names(config: dict) -> dict[str, str]:
    """GGUF name -> HF name for every tensor the architecture can have (experts: see EXPERTS)."""
    tmap, hp = name_map(config), text_hparams(config)
    layer = HF_LAYER + HF_LAYER_FUSED if arch_spec(config).fused_qkv_mlp else HF_LAYER
    names = list(HF_GLOBAL) + [n.format(i=i) for i in range(hp["num_hidden_layers"]) for n in layer]
    pairs = ((tmap.get_name(n, try_suffixes=(".weight", ".bias")), n) for n in names)
    return {g: n for g, n in pairs if g is not None}


def expert_tensors(experts: dict[tuple[int, str], np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' fused in-memory expert weights from the stacked GGUF ones."""
    out = {}
    for layer in sorted({i for i, _ in experts}):
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = np.concatenate([experts[layer, "gate"], experts[layer, "up"]], axis=1)
        out[prefix + "down_proj"] = experts[layer, "down"]
    return out


def text_config(hf_config: dict) -> dict:
    return hf_config.get("text_config", hf_config) if "num_hidden_layers" not in hf_config else hf_config


def dequantize(tensor) -> np.ndarray:
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def restore(config: dict, hf: str, data: np.ndarray) -> np.ndarray:
    """Undo the converter's per-tensor transformation (permutation, norm shift, vocabulary trim)."""
    hp = text_hparams(config)
    if (heads := permute_heads(config, hf)) is not None:
        data = unpermute(data, heads)
    if norm_shift(config, hf):
        data = data - np.float32(1)
    if hf == "model.embed_tokens.weight" and data.shape[0] < hp["vocab_size"]:
        data = np.concatenate([data, np.zeros((hp["vocab_size"] - data.shape[0], data.shape[1]), np.float32)])
    return data


def to_hf_state_dict(gguf_path, hf_config_dict: dict) -> dict:
    """{HF name: float32 torch.Tensor} from a .gguf written for this config."""
    import gguf
    import torch

    config = hf_config_dict
    mapping = hf_names(config)
    arrays, experts = {}, {}
    for tensor in gguf.GGUFReader(str(gguf_path)).tensors:
        if tensor.name in GENERATED:
            continue
        if (m := EXPERTS.match(tensor.name)) is not None:
            experts[int(m.group(1)), m.group(2)] = dequantize(tensor)
        elif tensor.name in mapping:
            arrays[mapping[tensor.name]] = restore(config, mapping[tensor.name], dequantize(tensor))
        else:
            raise ModelError(f"{Path(gguf_path).name}: tensor '{tensor.name}' has no Hugging Face counterpart")
    arrays.update(expert_tensors(experts))
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32, order="C")) for k, v in arrays.items()}
    if "lm_head.weight" not in state:  # no output tensor: llama.cpp uses the token embedding
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    prefix = LANGUAGE_MODEL_PREFIX.get((config.get("architectures") or [""])[0])
    if prefix:
        state = {k if k == "lm_head.weight" else prefix + k[len("model."):]: v for k, v in state.items()}
    return state
