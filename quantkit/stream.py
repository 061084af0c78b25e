"""Layer-streamed forwards: evaluate a model whose weights are never all in memory at once.

The transformers model is built on the meta device (parameters only; buffers such as rotary
frequencies and Gemma's embedding scale are computed as usual). Every streamed unit (the token
embedding, each decoder layer, the final norm) carries accelerate's AlignDevicesHook with
`offload=True` and a lazy `weights_map`: just before the unit runs, its weights are read from a
WeightSource (a safetensors checkpoint or a .gguf, one tensor at a time), cast to the compute
dtype and placed on the execution device; right after, they go back to meta and are freed. The
model's own forward runs unchanged (masks, rotary, sliding windows, Gemma's scaling and attention
softcaps) for every architecture transformers has.

The windows go through in groups (all at once when the activations fit ACTIVATION_BYTES), so each
layer is read once per group, not once per window. The base model stops at the last hidden states;
the output head is materialized once per group and applied to a chunk of positions at a time
(with the config's final_logit_softcapping, as the model's forward does), and each chunk's
log-probs are handed to the evaluator as a ScoredChunk and dropped. Peak memory: one unit's
weights + one group's activations + one chunk of logits, whatever the model's size.

Numerics equal the in-memory path's: the same modules run in the same dtype (the stored dtype
for a checkpoint, as `quantkit.model.load_model` loads it; float32 for a .gguf, as
`quantkit.artifacts.load_gguf_into_base` builds it), and logits are cast to float32 only after
the head (and softcap), as `evaluate.model_logits_fn` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from quantkit.errors import ModelError
from quantkit.evaluate import ScoredChunk, Scorer, chunk_rows, iter_batches

ACTIVATION_BYTES = 512 * 1024 * 1024  # working set of one group of windows inside one decoder layer
# safetensors dtype -> torch dtype name
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class WeightSource(Protocol):
    """Weights by Hugging Face tensor name, each produced on demand (nothing is kept)."""

    def keys(self) -> Iterable[str]: ...

    def get(self, name: str) -> "torch.Tensor": ...  # noqa: F821

    def shape(self, name: str) -> tuple[int, ...]: ...  # the tensor's Hugging Face shape, without reading it


# ------------------------------------------------------------------ sources


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def safetensors_index(file: Path) -> dict[str, StoredTensor]:
    """Where each tensor of one .safetensors file lies (its header only, read by quantkit.model)."""
    from quantkit.model import safetensors_layout

    header, base = safetensors_layout(file)
    return {name: StoredTensor(file, e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0],
                               e["data_offsets"][1] - e["data_offsets"][0])
            for name, e in header.items() if name != "__metadata__"}


def read_stored(entry: StoredTensor) -> "torch.Tensor":  # noqa: F821
    """One tensor in its stored dtype, read with a plain file read.

    Not safe_open: its memory map keeps every page it has served resident (counted in the RSS and
    growing with the checkpoint), which is what streaming is meant to avoid (see
    quantkit.gguf.convert.SafetensorsRows)."""
    import torch

    tensor = torch.empty(entry.shape, dtype=getattr(torch, TORCH_DTYPES[entry.dtype]))
    raw = tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else bytearray()
    with open(entry.file, "rb") as fh:
        fh.seek(entry.offset)
        if fh.readinto(memoryview(raw)) != entry.nbytes:
            raise ModelError(f"{entry.file.name}: tensor data is truncated")
    return tensor


class SafetensorsWeights:
    """The tensors of a checkpoint directory's *.safetensors files, read one at a time."""

    def __init__(self, model_dir: Path):
        from quantkit.model import weight_files

        self.index: dict[str, StoredTensor] = {}
        for file in weight_files(Path(model_dir)):
            self.index.update(safetensors_index(file))

    def keys(self) -> list[str]:
        return list(self.index)

    def get(self, name: str) -> "torch.Tensor":  # noqa: F821
        return read_stored(self.index[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name].shape


class WeightsMap(Mapping):
    """A WeightSource as the lazy Mapping accelerate's hooks read, by the model's parameter names.

    A tied parameter (lm_head.weight = model.embed_tokens.weight) is read under whichever of its
    names the source has."""

    def __init__(self, source: WeightSource, names: dict[str, str]):
        self.source = source
        self.names = names  # model parameter name -> source name

    def __getitem__(self, name: str):
        return self.source.get(self.names[name])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def tied_groups(model) -> list[list[str]]:
    """Parameter names grouped by the tensor they share (a group of one for an untied parameter)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def source_names(model, source: WeightSource) -> dict[str, str]:
    """Every parameter of the model -> the source tensor holding it; ModelError for any missing."""
    available = set(source.keys())
    names, missing = {}, []
    for group in tied_groups(model):
        found = [n for n in group if n in available]
        if not found:
            missing += group
        names.update({n: found[0] for n in group} if found else {})
    if missing:
        raise ModelError(f"the weights lack tensors that config.json calls for: {sorted(missing)[:3]} "
                         f"(and {max(0, len(missing) - 3)} more)",
                         hint="config.json and the weights do not belong together, or a file is missing")
    check_shapes(model, source, names)
    return names


def check_shapes(model, source: WeightSource, names: dict[str, str]) -> None:
    """ModelError when a stored tensor's shape is not the one the config gives its parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    wrong = [f"{source_name} (stored {list(source.shape(source_name))}, config.json {list(params[name].shape)})"
             for name, source_name in names.items() if tuple(source.shape(source_name)) != tuple(params[name].shape)]
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ModelError(f"{len(wrong)} shapes disagree with config.json: {', '.join(sorted(wrong)[:3])}{more}",
                         hint="config.json and the weights do not belong together, or a file is damaged")


# ------------------------------------------------------------------ the streamed model


def windows_per_group(config, seq_len: int, budget: int = ACTIVATION_BYTES) -> int:
    """Windows run through a layer together so one layer's float32 working set stays near budget:
    per token a few hidden-size vectors, the MLP's intermediate activations (gate, up, product)
    and one row of attention scores per head."""
    heads = config.num_attention_heads
    per_token = 8 * config.hidden_size + 3 * config.intermediate_size + 2 * heads * seq_len
    return max(1, budget // (4 * per_token * seq_len))


def build_meta_model(config, dtype):
    """The CausalLM of this config, parameters on the meta device, buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # not done under init_empty_weights; tied_groups relies on it
    return model.eval()


def streamed_units(decoder) -> Iterator[tuple[str, object]]:
    """(name, module) of each unit loaded at a time: each element of the decoder's layer lists
    and each other child holding parameters (embedding, final norm)."""
    import torch

    for name, child in decoder.named_children():
        if isinstance(child, torch.nn.ModuleList):
            yield from ((f"{name}.{i}", layer) for i, layer in enumerate(child))
        elif any(True for _ in child.parameters()):
            yield name, child


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    Without it the RSS grew by about half a layer per layer: once glibc's dynamic mmap threshold has
    risen, freed weights stay in the heap (and the torch threads' arenas) in fragments the next
    layer's allocations do not fill (measured: +15 MiB per layer on a 24-layer model, flat with it)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return
    trim(0)


def offload_hook(weights: WeightsMap, prefix: str, device):
    """accelerate's offloading hook over the unit's slice of the weights, trimming the heap after."""
    from accelerate.hooks import AlignDevicesHook
    from accelerate.utils import PrefixedDataset

    class StreamingHook(AlignDevicesHook):
        def post_forward(self, module, output):
            output = super().post_forward(module, output)
            release_freed_memory()
            return output

    return StreamingHook(execution_device=device, offload=True, weights_map=PrefixedDataset(weights, prefix),
                         place_submodules=True)


def module_prefixes(model) -> dict[int, str]:
    return {id(module): f"{name}." if name else "" for name, module in model.named_modules()}


def attach_streaming(model, weights: WeightsMap, device) -> None:
    """Hook every streamed unit of the decoder so its weights live only while it runs."""
    from accelerate.hooks import add_hook_to_module
    from accelerate.utils import set_module_tensor_to_device

    prefixes = module_prefixes(model)
    for _, unit in streamed_units(model.get_decoder()):
        add_hook_to_module(unit, offload_hook(weights, prefixes[id(unit)], device))
    for name, _ in model.named_buffers():
        set_module_tensor_to_device(model, name, device)


@contextmanager
def materialized(module, weights: WeightsMap, prefix: str, device):
    """The module's weights loaded for the duration (the same hook, driven by hand: the output
    head serves many chunks per load)."""
    hook = offload_hook(weights, prefix, device)
    hook.init_hook(module)
    hook.pre_forward(module)
    try:
        yield module
    finally:
        hook.post_forward(module, None)


@dataclass
class StreamedModel:
    model: object  # transformers CausalLM on the meta device, streamed units hooked
    weights: WeightsMap
    device: object
    softcap: float | None  # final_logit_softcapping

    @property
    def head(self):
        return self.model.get_output_embeddings()


def stream_model(config, source: WeightSource, dtype, device="cpu") -> StreamedModel:
    """A meta-device model of `config` whose weights come from `source` unit by unit."""
    model = build_meta_model(config, dtype)
    weights = WeightsMap(source, source_names(model, source))
    attach_streaming(model, weights, device)
    softcap = config.get_text_config().to_dict().get("final_logit_softcapping")
    return StreamedModel(model, weights, device, softcap)


def last_hidden(streamed: StreamedModel, ids):
    """Hidden states after the final norm for predictions 0..L-2, flattened to (positions, hidden)."""
    hidden = streamed.model.get_decoder()(input_ids=ids.to(streamed.device), use_cache=False).last_hidden_state
    return hidden[:, :-1].reshape(-1, hidden.shape[-1])


def head_logits(head, hidden, softcap: float | None):
    """Logits of a block of positions, softcapped as the model's own forward does it."""
    import torch

    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def score_group(streamed: StreamedModel, ids) -> Iterator[ScoredChunk]:
    """Run one group of windows through the streamed layers, then score it a chunk at a time.

    Our own loop for the head only: the CausalLM's forward would make the group's whole
    [positions x vocab] logits at once, and a hooked head would be re-read for every chunk."""
    import torch

    hidden = last_hidden(streamed, ids)
    targets = ids[:, 1:].reshape(-1)
    step = chunk_rows(streamed.head.out_features)
    prefix = module_prefixes(streamed.model)[id(streamed.head)]
    with materialized(streamed.head, streamed.weights, prefix, streamed.device) as head:
        for start in range(0, hidden.shape[0], step):
            logits = head_logits(head, hidden[start : start + step], streamed.softcap)
            yield ScoredChunk(torch.log_softmax(logits.float(), dim=-1).cpu(), targets[start : start + step])


def streamed_scorer(config, source: WeightSource, dtype, device="cpu", activation_bytes: int = ACTIVATION_BYTES
                    ) -> Scorer:
    """A Scorer (evaluate.compute_baseline / compare) running `config`'s model layer by layer
    from `source`, in `dtype` on `device`."""

    def scorer(windows) -> Iterator[ScoredChunk]:
        import torch

        streamed = stream_model(config, source, dtype, device)
        group = windows_per_group(config.get_text_config(), windows.shape[1], activation_bytes)
        with torch.inference_mode():
            for ids in iter_batches(windows, group):
                yield from score_group(streamed, ids)

    return scorer


# ------------------------------------------------------------------ scorers for checkpoints and artifacts


def streamable(config: dict) -> bool:
    """Whether the streamed forward applies: a full-precision text decoder whose checkpoint names
    are its module names (not a VLM, whose towers and forward differ; not a quantized checkpoint,
    whose weights need its engine's modules; not a model transformers converts while loading,
    such as Mixtral's and Qwen3-MoE's per-expert tensors fused into one)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from quantkit.model import is_vlm

    return (not is_vlm(config) and "quantization_config" not in config
            and not get_checkpoint_conversion_mapping(config.get("model_type", "")))


def checkpoint_scorer(model_dir: Path, dtype: str = "auto", device: str = "cpu",
                      activation_bytes: int = ACTIVATION_BYTES) -> Scorer:
    """A full-precision checkpoint streamed from its safetensors, in `dtype` ('auto': the stored
    dtype, as quantkit.model.load_model and from_pretrained load it)."""
    from quantkit.model import check_model_dir, device_map, hf_config, torch_dtype

    info = check_model_dir(Path(model_dir))
    config = hf_config(model_dir)  # streamed only without trust_remote_code
    return streamed_scorer(config, SafetensorsWeights(model_dir), torch_dtype(dtype, info), device_map(device),
                           activation_bytes)


def gguf_scorer(path: Path, base_dir: Path, device: str = "cpu", activation_bytes: int = ACTIVATION_BYTES) -> Scorer:
    """A .gguf in the base's architecture, dequantized a tensor at a time, computed in float32
    (as artifacts.load_gguf_into_base does)."""
    import torch

    from quantkit.gguf.loader import GGUFTensors
    from quantkit.model import device_map, hf_config

    config = hf_config(base_dir)  # streamed only without trust_remote_code
    return streamed_scorer(config, GGUFTensors(path, config.to_dict()), torch.float32, device_map(device),
                           activation_bytes)


def loaded_scorer(path: Path, base_dir: Path | None, device: str = "cpu", trust_remote_code: bool = False) -> Scorer:
    """The artifact loaded whole when scoring starts and dropped when it ends (evaluate.model_scorer)."""
    from quantkit.artifacts import load_for_eval
    from quantkit.evaluate import model_scorer

    def scorer(windows) -> Iterator[ScoredChunk]:
        yield from model_scorer(load_for_eval(path, base_dir, device, trust_remote_code))(windows)

    return scorer


def artifact_scorer(path: Path, base_dir: Path | None = None, device: str = "cpu",
                    trust_remote_code: bool = False) -> Scorer:
    """A Scorer for any artifact quantkit evaluates: a .gguf or a full-precision text decoder is
    streamed layer by layer; a compressed-tensors or bitsandbytes checkpoint (weights already 4-8 bit,
    restored by its engine's own modules) and a VLM load whole through transformers."""
    from quantkit.artifacts import artifact_kind, gguf_file
    from quantkit.errors import InputError
    from quantkit.model import is_vlm, read_config

    kind = artifact_kind(path)
    if kind == "gguf":
        if base_dir is None:
            raise InputError("evaluating a .gguf needs the base checkpoint", hint="pass --against BASE_DIR")
        if is_vlm(read_config(Path(base_dir))):  # the language model goes into the whole base (its towers)
            return loaded_scorer(path, base_dir, device, trust_remote_code)
        return gguf_scorer(gguf_file(path), base_dir, device)
    if kind == "transformers" and streamable(read_config(path)) and not trust_remote_code:
        return checkpoint_scorer(path, "auto", device)
    return loaded_scorer(path, base_dir, device, trust_remote_code)
