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
from quantkit.gguf.convert import SLAB_ELEMENTS, arch_spec, name_map, norm_shift, permute_heads, unpermute

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
    """dequantize(tensor) from the file, or ModelError naming the file when its data is damaged."""
    try:
        return dequantize(tensor, read_tensor_data(path, tensor))
    except READER_ERRORS as exc:
        raise ModelError(f"{path.name}: tensor '{tensor.name}' cannot be decoded ({type(exc).__name__}: {exc})"
                         .splitlines()[0], hint=f"the file is corrupt: {path}") from exc


def text_config(hf_config: dict) -> dict:
    return hf_config.get("text_config", hf_config) if "num_hidden_layers" not in hf_config else hf_config


def read_tensor_data(path: Path, tensor) -> np.ndarray:
    """One tensor's stored data (raw blocks or floats, shaped like gguf-py's view of it), read with
    a plain file read: the reader's memory map would keep every page visited resident."""
    view = tensor.data  # a memmap view: its dtype and shape only, no page is touched
    with open(path, "rb") as fh:
        data = np.fromfile(fh, dtype=np.uint8, count=int(tensor.n_bytes), offset=int(tensor.data_offset))
    return data.view(view.dtype).reshape(view.shape)


def dequantize(tensor, data: np.ndarray | None = None) -> np.ndarray:
    """float32 values of a tensor, dequantized a slab of rows at a time into the result (gguf-py's
    whole-tensor temporaries are several times the float32 size of a 128k-vocab embedding)."""
    import gguf

    data = tensor.data if data is None else data
    out = np.empty(tuple(int(d) for d in reversed(tensor.shape)), dtype=np.float32)
    if out.ndim < 2:
        out[...] = gguf.quants.dequantize(data, tensor.tensor_type).reshape(out.shape)
        return out
    step = max(1, SLAB_ELEMENTS // int(np.prod(out.shape[1:])))
    for start in range(0, out.shape[0], step):
        part = out[start : start + step]
        part[...] = gguf.quants.dequantize(data[start : start + step], tensor.tensor_type).reshape(part.shape)
    return out


def hf_weight(data: np.ndarray, hf_name: str, config: dict):
    """A dequantized GGUF tensor as the HF weight: Q/K rows unpermuted, Gemma's norm shift undone."""
    import torch

    if (heads := permute_heads(config, hf_name)) is not None:
        data = unpermute(data, heads)
    if norm_shift(config, hf_name):
        data = data - np.float32(1)
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))  # copies only unpermuted rows


def tied_output(config: dict) -> bool:
    """lm_head is the token embedding when the file has no output tensor (Gemma always; else when tied)."""
    return bool(arch_spec(config).gemma) or not config.get("tie_word_embeddings", False)


class GGUFTensors:
    """The tensors of a .gguf by HF name, each dequantized on demand (float32 torch tensors).

    Only the header is parsed up front; `get(name)` reads, dequantizes and transforms one tensor.
    """

    def __init__(self, gguf_path, hf_config_dict: dict):
        self.path = Path(gguf_path)
        self.config = text_config(hf_config_dict)
        mapping = hf_names(self.config)
        reader = open_reader(self.path)
        self.tensors = {}
        for tensor in reader.tensors:
            if tensor.name not in mapping:
                raise ModelError(f"{self.path.name}: tensor '{tensor.name}' has no Hugging Face counterpart")
            self.tensors[mapping[tensor.name]] = tensor
        self.aliases = {}
        if "lm_head.weight" not in self.tensors and tied_output(self.config):
            self.aliases["lm_head.weight"] = "model.embed_tokens.weight"

    def keys(self) -> list[str]:
        return [*self.tensors, *self.aliases]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[self.aliases.get(name, name)].shape))

    def get(self, name: str):
        name = self.aliases.get(name, name)
        tensor = self.tensors[name]
        return hf_weight(dequantize_checked(tensor, self.path), name, self.config)


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
    source = GGUFTensors(gguf_path, hf_config_dict)
    state = {name: source.get(name) for name in source.tensors}
    for alias, name in source.aliases.items():
        state[alias] = state[name]
    return state
