"""GGUF -> Hugging Face state dict (float32 torch tensors), for evaluating a .gguf in transformers.

Every tensor is dequantized with gguf-py, its GGUF name mapped back to the HF name through the
same TensorNameMap the converter uses (inverted over the HF names this architecture has), and
the llama Q/K row permutation undone, Gemma's norm weights shifted back (w - 1) and Gemma's
output taken from the tied embedding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quantkit.errors import ModelError
from quantkit.gguf.convert import arch_spec, name_map, norm_shift, permute_heads, unpermute

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
    "model.layers.{i}.pre_feedforward_layernorm.weight", "model.layers.{i}.post_feedforward_layernorm.weight",
]


def hf_names(config: dict) -> dict[str, str]:
    """GGUF name -> HF name for every tensor the architecture can have."""
    tmap = name_map(config)
    names = list(HF_GLOBAL)
    for i in range(config["num_hidden_layers"]):
        names += [n.format(i=i) for n in HF_LAYER]
    pairs = ((tmap.get_name(n, try_suffixes=(".weight", ".bias")), n) for n in names)
    return {g: n for g, n in pairs if g is not None}


def dequantize_checked(tensor, path: Path) -> np.ndarray:
    try:
        return dequantize(tensor)
    except READER_ERRORS as exc:
        raise ModelError(f"{path.name}: tensor '{tensor.name}' cannot be decoded ({type(exc).__name__}: {exc})"
                         .splitlines()[0], hint=f"the file is corrupt: {path}") from exc


def text_config(hf_config: dict) -> dict:
    return hf_config.get("text_config", hf_config) if "num_hidden_layers" not in hf_config else hf_config


def dequantize(tensor) -> np.ndarray:
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


# What gguf-py raises on a damaged file (bad magic, short header, tensor data past the end, an
# unknown type id); each becomes a ModelError naming the file.
READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, NotImplementedError, EOFError)


def open_reader(gguf_path):
    """gguf.GGUFReader over the file (memory-mapped: cheap), or ModelError naming the file."""
    import gguf

    path = Path(gguf_path)
    try:
        reader = gguf.GGUFReader(str(path))
        for tensor in reader.tensors:  # types known, data within the file
            gguf.GGMLQuantizationType(tensor.tensor_type)
    except READER_ERRORS as exc:
        raise ModelError(f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc})".splitlines()[0],
                         hint=f"the file is truncated or corrupt: {path}") from exc
    return reader


def to_hf_state_dict(gguf_path, hf_config_dict: dict) -> dict:
    """{HF name: float32 torch.Tensor} from a .gguf written for this config."""
    import gguf
    import torch

    config = text_config(hf_config_dict)
    arch_spec(config)
    mapping = hf_names(config)
    reader = open_reader(gguf_path)
    state = {}
    for tensor in reader.tensors:
        if tensor.name not in mapping:
            raise ModelError(f"{Path(gguf_path).name}: tensor '{tensor.name}' has no Hugging Face counterpart")
        hf = mapping[tensor.name]
        data = dequantize_checked(tensor, Path(gguf_path))
        if (heads := permute_heads(config, hf)) is not None:
            data = unpermute(data, heads)
        if norm_shift(config, hf):
            data = data - np.float32(1)
        state[hf] = torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))
    if "lm_head.weight" not in state and (arch_spec(config).gemma or not config.get("tie_word_embeddings", False)):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
