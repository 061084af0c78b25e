"""GGUF -> Hugging Face tensors (float32 torch), for evaluating a .gguf in transformers.

`GGUFTensors` gives one HF tensor on demand (the layer-streamed forwards read a .gguf that way);
`to_hf_state_dict` builds the whole state dict from it. Every tensor is dequantized with gguf-py, its GGUF name mapped back to the HF name through the
same TensorNameMap the converter uses (inverted over the HF names this architecture has), and
each conversion step undone: the llama Q/K row permutation, Gemma's norm shift (w - 1), stacked
experts turned into transformers' in-memory expert tensors (mlp.experts.gate_up_proj = gate and
up concatenated per expert, mlp.experts.down_proj; the router is mlp.gate; a family whose own step names
them reads them under its names: Granite 4's block_sparse_moe.experts.*), Gemma 3's trimmed embedding rows restored (zero;
they are ids no tokenizer produces), a missing output taken from the tied embedding, a tensor the
converter split joined from its pieces (TensorRule.split / pieces: DeepSeek's attn_k_b and attn_v_b
into kv_b_proj). Generated tensors (rope_freqs, LongRoPE factors) have no HF counterpart and are skipped. Phi-3's fused
qkv_proj / gate_up_proj are fused in HF too. A VLM's language model gets the VLM's names
(`model.language_model.*`); its towers are not in the file (they are in the mmproj .gguf beside it).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from quantkit.errors import ModelError
from quantkit.arch.families.text import text_hparams
from quantkit.gguf.convert import (SLAB_ELEMENTS, arch_spec, name_map, norm_shift, permute_heads, source_name,
                                   split_names, tensor_rule, unpermute)

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
LANGUAGE_MODEL_PREFIX = {**{arch: "model.language_model." for arch in (
    "Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Mistral3ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Gemma4ForConditionalGeneration")},
    "Idefics3ForConditionalGeneration": "model.text_model.", "SmolVLMForConditionalGeneration": "model.text_model."}
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def hf_names(config: dict) -> dict[str, str]:
    """GGUF name -> HF name for every tensor the architecture can have (experts: see EXPERTS): the names of
    the decoders above, then those of the architecture's transformers model that map to a GGUF name no
    other does (a family's own tensors: linear attention, per-layer inputs), each renamed as the family's
    conversion renames it."""
    tmap, hp = name_map(config), text_hparams(config)
    layer = HF_LAYER + HF_LAYER_FUSED if arch_spec(config).fused_qkv_mlp else HF_LAYER
    names = list(HF_GLOBAL) + [n.format(i=i) for i in range(hp["num_hidden_layers"]) for n in layer]
    pairs = ((tmap.get_name(n, try_suffixes=(".weight", ".bias")), n) for n in names)
    found = {g: n for g, n in pairs if g is not None}
    if not arch_spec(config).rules and not arch_spec(config).own_names:
        return found
    names = model_names(config)
    if arch_spec(config).own_names:  # the model's own names win over the Llama-style decoder's
        present = set(names)
        found = {g: n for g, n in found.items() if n in present}
    for name in names:
        source = source_name(name)
        if source is None:
            continue
        rule = tensor_rule(config, source)
        for mapped in split_names(rule, source):  # a split tensor's pieces all read back into it
            gguf = tmap.get_name(mapped, try_suffixes=(".weight", ".bias"))
            # a family's own step names its target (over the generic decoder name for the same GGUF tensor)
            if gguf is not None and (gguf not in found or (rule is not None and bool(rule.rename or rule.split))):
                found[gguf] = source
    return found


def model_names(config: dict) -> list[str]:
    """The state-dict names of the config's transformers causal LM (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

    # config.json's encoded infinities ({"__float__": "Infinity"}: Granite 4's time_step_limit) decoded as
    # from_pretrained decodes them
    rest = PreTrainedConfig._decode_special_floats({k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **rest))
    return list(model.state_dict())


def read_tensor_data(path: Path, tensor) -> np.ndarray:
    """One tensor's stored data (raw blocks or floats, shaped like gguf-py's view of it), read with
    a plain file read: the reader's memory map would keep every page visited resident."""
    return read_rows_data(path, tensor, np.arange(int(tensor.data.shape[0])))


def read_rows_data(path: Path, tensor, index: np.ndarray) -> np.ndarray:
    """The stored data of rows `index` (sorted, unique; along the first HF dimension) of a tensor,
    one plain read per run of consecutive rows."""
    from quantkit.io.rowio import byte_view, pread_into, row_runs

    view = tensor.data  # a memmap view: its dtype and shape only, no page is touched
    out = np.empty((len(index), *view.shape[1:]), dtype=view.dtype)
    row_bytes = int(tensor.n_bytes) // int(view.shape[0])
    raw = byte_view(out)
    with open(path, "rb") as fh:
        for position, row, count in row_runs(index):
            pread_into(fh.fileno(), raw[position * row_bytes : (position + count) * row_bytes],
                       int(tensor.data_offset) + row * row_bytes)
    return out


def dequantize(tensor, data: np.ndarray | None = None) -> np.ndarray:
    """float32 values of a tensor (or of the rows of it in `data`), dequantized a slab of rows at a
    time into the result (gguf-py's whole-tensor temporaries are several times the float32 size of
    a 128k-vocab embedding)."""
    import gguf

    data = tensor.data if data is None else data
    shape = tuple(int(d) for d in reversed(tensor.shape))
    out = np.empty((data.shape[0], *shape[1:]) if len(shape) > 1 else shape, dtype=np.float32)
    if out.ndim < 2:
        out[...] = gguf.quants.dequantize(data, tensor.tensor_type).reshape(out.shape)
        return out
    step = max(1, SLAB_ELEMENTS // int(np.prod(out.shape[1:])))
    for start in range(0, out.shape[0], step):
        part = out[start : start + step]
        part[...] = gguf.quants.dequantize(data[start : start + step], tensor.tensor_type).reshape(part.shape)
    return out


def dequantize_checked(tensor, path: Path, index: np.ndarray | None = None) -> np.ndarray:
    """dequantize(tensor) from the file (only rows `index` when given), or ModelError naming the
    file when its data is damaged."""
    try:
        data = read_tensor_data(path, tensor) if index is None else read_rows_data(path, tensor, index)
        return dequantize(tensor, data)
    except READER_ERRORS as exc:
        raise ModelError(f"{path.name}: tensor '{tensor.name}' cannot be decoded ({type(exc).__name__}: {exc})"
                         .splitlines()[0], hint=f"the file is corrupt: {path}") from exc


def restore(config: dict, hf: str, data: np.ndarray) -> np.ndarray:
    """Undo the converter's per-tensor transformation (the family's step, permutation, norm shift, vocabulary
    trim)."""
    hp = text_hparams(config)
    rule = tensor_rule(config, hf)
    if rule is not None and rule.inverse is not None:
        data = rule.inverse(data, hp)
    if (heads := permute_heads(config, hf)) is not None:
        data = unpermute(data, heads)
    if norm_shift(config, hf):
        data = data - np.float32(1)
    if hf == "model.embed_tokens.weight" and data.shape[0] < hp["vocab_size"]:
        data = np.concatenate([data, np.zeros((hp["vocab_size"] - data.shape[0], data.shape[1]), np.float32)])
    return data


def from_written(config: dict, hf: str, parts: list[np.ndarray]) -> np.ndarray:
    """A Hugging Face tensor from the float32 values the converter writes for it: one tensor, or a split's pieces
    in split order, joined as the family's step cut them (row blocks along the second-to-last axis, or
    TensorRule.pieces' own join), then restored (restore)."""
    rule = tensor_rule(config, hf)
    if rule is None or not rule.split:
        (data,) = parts
    else:
        data = np.concatenate(parts, axis=-2) if rule.pieces is None else rule.pieces.join(parts, text_hparams(config))
    return restore(config, hf, data)


def restored_shape(hf: str, shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    """The shape restore() gives a stored tensor: Gemma 3's trimmed embedding with its vocab_size rows."""
    if hf == "model.embed_tokens.weight" and shape[0] < hp["vocab_size"]:
        return (hp["vocab_size"], *shape[1:])
    return shape


class GGUFTensors:
    """The tensors of a .gguf by HF name (the language model's plain names, `model.*`), each
    dequantized and restored on demand as a float32 torch tensor.

    Only the header is parsed up front. Stacked experts become transformers' fused
    `mlp.experts.gate_up_proj` / `down_proj`; a missing output is the tied token embedding.
    """

    def __init__(self, gguf_path, hf_config_dict: dict):
        self.path = Path(gguf_path)
        self.config = hf_config_dict
        mapping = hf_names(self.config)
        self.tensors, self.experts, self.pieces = {}, {}, {}
        layers = text_hparams(self.config)["num_hidden_layers"]
        reader = open_reader(self.path)
        self.metadata = metadata_tensors(reader, self.config)
        for tensor in reader.tensors:
            if tensor.name in GENERATED or block_of(tensor.name) >= layers:  # MTP blocks: no transformers module
                continue
            rule = tensor_rule(self.config, mapping[tensor.name]) if tensor.name in mapping else None
            if rule is not None and rule.split:
                self.pieces.setdefault(mapping[tensor.name], {})[tensor.name] = tensor
            elif rule is None and (m := EXPERTS.match(tensor.name)) is not None:  # the family's step names its own
                self.experts[int(m.group(1)), m.group(2)] = tensor
            elif tensor.name in mapping:
                self.tensors[mapping[tensor.name]] = tensor
            else:
                raise ModelError(f"{self.path.name}: tensor '{tensor.name}' has no Hugging Face counterpart",
                                 hint="quantkit reads back the .gguf files it writes from the architectures in "
                                      "docs/models.md; compare others with llama-perplexity")
        self.aliases = {} if "lm_head.weight" in self.tensors else {"lm_head.weight": "model.embed_tokens.weight"}
        self.pieces = {name: self.ordered_pieces(name, found) for name, found in self.pieces.items()}

    def ordered_pieces(self, name: str, found: dict) -> list:
        """A split tensor's pieces in the family's split order (each must be in the file)."""
        tmap = name_map(self.config)
        pieces = split_names(tensor_rule(self.config, name), name)
        names = [tmap.get_name(n, try_suffixes=(".weight", ".bias")) for n in pieces]
        missing = [n for n in names if n not in found]
        if missing:
            raise ModelError(f"{self.path.name}: tensor '{missing[0]}' is missing (a piece of {name})",
                             hint=f"the file is incomplete or was written for another model: {self.path}")
        return [found[n] for n in names]

    def expert_names(self) -> list[str]:
        layers = sorted({i for i, _ in self.experts})
        return [f"model.layers.{i}.mlp.experts.{kind}" for i in layers for kind in ("gate_up_proj", "down_proj")]

    def keys(self) -> list[str]:
        return [*self.tensors, *self.pieces, *self.expert_names(), *self.metadata, *self.aliases]

    def shape(self, name: str) -> tuple[int, ...]:
        name = self.aliases.get(name, name)
        if name in self.metadata:
            return tuple(self.metadata[name].shape)
        if name in self.tensors or name in self.pieces:
            rule, hp = tensor_rule(self.config, name), text_hparams(self.config)
            if name in self.pieces and rule.pieces is not None:  # pieces of their own shapes
                return tuple(rule.pieces.hf_shape([stored_shape(t) for t in self.pieces[name]], hp))
            shape = stored_shape(self.tensors[name]) if name in self.tensors else joined_shape(self.pieces[name])
            shape = shape if rule is None or rule.hf_shape is None else tuple(rule.hf_shape(shape, hp))
            return restored_shape(name, shape, hp)
        layer, kinds = self.expert_parts(name)
        shapes = [stored_shape(self.experts[layer, k]) for k in kinds]
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])

    def get(self, name: str):
        import torch

        name = self.aliases.get(name, name)
        if name in self.metadata:
            return torch.from_numpy(self.metadata[name].copy())  # its own shape (0-d for a scalar buffer)
        if name in self.tensors:
            data = restore(self.config, name, dequantize_checked(self.tensors[name], self.path))
        elif name in self.pieces:
            data = from_written(self.config, name, [dequantize_checked(t, self.path) for t in self.pieces[name]])
        else:
            layer, kinds = self.expert_parts(name)
            data = np.concatenate([dequantize_checked(self.experts[layer, k], self.path) for k in kinds], axis=1)
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))  # copies only unpermuted rows

    def rows(self, name: str, index):
        """Rows `index` (sorted, unique) of a tensor, dequantizing only those rows where the
        converter stored them as they are (embeddings, the head, plain projections); Gemma 3's
        trimmed embedding rows are zero, as in restore()."""
        import torch

        name = self.aliases.get(name, name)
        tensor = self.tensors.get(name)
        if (tensor is None or len(tensor.shape) != 2 or permute_heads(self.config, name) is not None
                or norm_shift(self.config, name) or tensor_rule(self.config, name) is not None):
            return self.get(name)[torch.as_tensor(np.asarray(index), dtype=torch.long)]
        index = np.asarray(index, dtype=np.int64)
        stored = int(np.searchsorted(index, int(tensor.shape[1])))  # rows past the file's are trimmed ones
        out = np.zeros((len(index), int(tensor.shape[0])), dtype=np.float32)
        out[:stored] = dequantize_checked(tensor, self.path, index[:stored])
        return torch.from_numpy(out)

    @staticmethod
    def expert_parts(name: str) -> tuple[int, tuple[str, ...]]:
        """(layer, stacked GGUF tensors) of a fused expert weight: gate_up_proj = gate then up (per
        expert, along the output rows), down_proj = down."""
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        return layer, ("down",) if name.endswith("down_proj") else ("gate", "up")


def block_of(name: str) -> int:
    """The block of a GGUF tensor (`blk.N.`), -1 for the others."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def metadata_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    """{HF name: float32 values} of the per-layer tensors the converter wrote as metadata arrays (the family's
    MetadataTensor rows: Apertus' xIELU parameters), each in its Hugging Face shape."""
    out = {}
    for m in arch_spec(config).metadata_tensors:
        field = reader.fields.get(m.key)
        if field is None:
            raise ModelError(f"the file lacks the metadata key {m.key}", hint="write it again with quantkit quantize")
        for i, value in enumerate(field.contents()):
            out[f"model.layers.{i}.{m.suffix}"] = np.full(m.shape, value, dtype=np.float32)
    return out


def stored_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))


def joined_shape(pieces: list) -> tuple[int, ...]:
    """The shape of a split tensor's pieces joined along their second-to-last axis."""
    shapes = [stored_shape(t) for t in pieces]
    return (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1])


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
    """{HF name: float32 torch.Tensor} from a .gguf written for this config (a VLM's language
    model under the VLM's names)."""
    source = GGUFTensors(gguf_path, hf_config_dict)
    state = {name: source.get(name) for name in source.keys() if name not in source.aliases}
    for alias, name in source.aliases.items():
        state[alias] = state[name]
    prefix = LANGUAGE_MODEL_PREFIX.get((hf_config_dict.get("architectures") or [""])[0])
    if prefix:
        state = {k if k == "lm_head.weight" else prefix + k[len("model."):]: v for k, v in state.items()}
    return state
