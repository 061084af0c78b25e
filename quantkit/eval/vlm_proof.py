"""The proof a VLM artifact carries, checked in the gate: its towers are the source's.

After the artifact is reloaded from disk through transformers (as a user would), every tensor of
every tower and projector (quantkit.arch.vlm) must be bit-identical to the source checkpoint's: same
dtype, same bytes. A missing tensor (quantized under another name) or a changed one fails the run
(TowerChangedError, exit 3). Then one image+text forward runs on the reloaded model: a synthetic
image through the artifact's own processor (its processor and chat-template files), so the
vision path is exercised end to end; without processor files that step is reported as skipped.

A target that quantizes a tower on request (`vision`/`projector`: int8 or int4, round-to-nearest)
writes those Linear modules in their own config group: their weights must then be within half a
quantization step of the source (symmetric, the row's largest step; plus the 16-bit rounding of the
reloaded value), and every other tower tensor (norms, biases, patch embeddings) still bit-identical.

A .gguf artifact keeps its towers in the mmproj file beside the language model (quantkit.gguf.mmproj).
`prove_mmproj` reads that file back from disk and checks it against the source checkpoint, read
independently (safetensors' torch reader, torch casts): every tower tensor of the source is in it
or left out for a reason llama.cpp's converter has (LLaVA's unused last CLIP layer, SigLIP's
pooling head), and every stored tensor's bytes equal the source tensor after the converter's
documented change (qkv split, Conv3D split per time step, Gemma's w + 1, Pixtral's q/k rows permuted) cast
to the stored type.
"Bit-identical" for a GGUF tower means exactly that. Whether the stored values are the source's
own values is reported per tensor: a bf16 tower written BF16 or F32 holds them exactly, a bf16
tensor written F16 (LLaVA's legacy format, Gemma 3's input projection, mmproj: f16) is rounded
to nearest even, and the w + 1 norm holds w + 1.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.errors import TowerChangedError
from quantkit.io.checkpoint import ModelInfo

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
IMAGE_SIZE = 64  # the synthetic image's side in pixels; processors resize it to what the model wants


def source_tower_tensors(info: ModelInfo) -> list[str]:
    """Checkpoint names of every tower tensor of the source."""
    return sorted(name for name in info.tensors if info.towers.role(name))


def checkpoint_to_module_names(model, names: list[str]) -> dict[str, str]:
    """The state-dict name transformers gives each checkpoint tensor name when loading `model`'s class."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model) or []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = model.state_dict()
    return {name: rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)[0]
            for name in names}


def read_source(info: ModelInfo, names: list[str]) -> dict:
    """The source's tensors `names`, read from its safetensors files (nothing else loaded)."""
    from safetensors import safe_open

    wanted, found = set(names), {}
    for file in info.weight_files:
        with safe_open(str(file), "pt") as f:
            for key in wanted.intersection(f.keys()):
                found[key] = f.get_tensor(key)
    return found


def read_piece_source(info: ModelInfo, piece):
    """The source rows an mmproj piece is made from (quantkit.gguf.mmproj.source_rows): one
    embedding row for a "token" piece, else the whole tensor."""
    from safetensors import safe_open

    from quantkit.gguf.mmproj import source_rows

    if piece.rule.split != "token":
        return read_source(info, [piece.source])[piece.source]
    for file in info.weight_files:
        with safe_open(str(file), "pt") as f:
            if piece.source in f.keys():
                part = f.get_slice(piece.source)
                return part[slice(*source_rows(piece, tuple(part.get_shape())))]
    raise KeyError(piece.source)


def same_bits(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def within_rounding(reloaded, source, bits: int) -> bool:
    """Symmetric round-to-nearest: each element within half a step (its row's largest) of the source,
    plus the 16-bit rounding of the dequantized value."""
    qmax = 2 ** (bits - 1) - 1
    s, r = source.float(), reloaded.float()
    step = s.abs().amax(dim=1, keepdim=True) / qmax
    return reloaded.shape == source.shape and bool(((r - s).abs() <= step * 0.5 + s.abs() * 2 ** -7 + 1e-6).all())


def weight_bits(model, module_name: str) -> int | None:
    """The weight bits of a reloaded compressed-tensors module, None for a 16-bit one."""
    from compressed_tensors.quantization.utils import is_module_quantized

    module = model.get_submodule(module_name)
    if not is_module_quantized(module) or module.quantization_scheme.weights is None:
        return None
    return module.quantization_scheme.weights.num_bits


def tower_differences(model, info: ModelInfo, quantized_roles: tuple[str, ...] = ()) -> tuple[int, int, list[str]]:
    """(tower tensors bit-identical, weights of the `quantized_roles` towers the artifact quantized and
    within rounding, the ones that differ, are out of bounds or are missing after reload)."""
    from quantkit.eval.artifacts import decompressed_weight

    names = source_tower_tensors(info)
    module_names = checkpoint_to_module_names(model, names)
    state = model.state_dict()
    source = read_source(info, names)
    identical, rounded, bad = 0, 0, []
    for name in names:
        reloaded = state.get(module_names[name])
        module = module_names[name].removesuffix(".weight")
        is_weight = module_names[name].endswith(".weight")
        bits = weight_bits(model, module) if is_weight and info.towers.role(name) in quantized_roles else None
        if bits:
            weight = decompressed_weight(model.get_submodule(module))
            ok = within_rounding(weight.cpu(), source[name], bits)
            rounded += ok
            bad += [] if ok else [f"{name} (int{bits} on request, off by more than half a step)"]
        elif reloaded is None:
            bad.append(f"{name} (missing)")
        elif same_bits(reloaded.detach().cpu(), source[name]):
            identical += 1
        else:
            bad.append(f"{name} ({dtype_name(source[name])} -> {dtype_name(reloaded)}, bits differ)")
    return identical, rounded, bad


def dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def synthetic_image():
    """A deterministic RGB gradient."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, IMAGE_SIZE, dtype=np.uint8)
    pixels = np.stack([np.add.outer(ramp, ramp) // 2, np.tile(ramp, (IMAGE_SIZE, 1)),
                       np.tile(ramp[:, None], (1, IMAGE_SIZE))], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_text_inputs(artifact: Path):
    """Image+text model inputs from the artifact's own processor and chat template; a 'skipped: ...' reason
    when it has no processor files or its processor needs a package not installed."""
    from transformers import AutoProcessor

    from quantkit.io.offline import offline

    if not any((artifact / name).is_file() for name in PROCESSOR_FILES):
        return "skipped: the artifact has no processor files"
    try:
        with offline():
            processor = AutoProcessor.from_pretrained(artifact, local_files_only=True)
    except ImportError as exc:  # the processor's own requirement (Gemma 4's: torchvision) is not installed here
        return f"skipped: its processor cannot be loaded here ({str(exc).splitlines()[0]})"
    messages = [{"role": "user", "content": [{"type": "image", "image": synthetic_image()},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


def image_forward(model, artifact: Path) -> str:
    """Run one image+text forward on the reloaded model; 'ran' or 'skipped: ...'."""
    import torch

    inputs = image_text_inputs(artifact)
    if isinstance(inputs, str):
        return inputs
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    try:
        with torch.inference_mode():
            logits = model(**inputs).logits
    except Exception as exc:  # noqa: BLE001 - any failure of the reloaded VLM on an image is the finding
        raise TowerChangedError(f"the reloaded VLM fails an image+text forward: {type(exc).__name__}: {exc}"
                                .splitlines()[0], hint="the artifact was not written") from exc
    if not torch.isfinite(logits.float()).all():
        raise TowerChangedError("the reloaded VLM gives non-finite logits on an image+text forward",
                                hint="the artifact was not written")
    return "ran"


def prove_towers(model, artifact: Path, info: ModelInfo, quantized_roles: tuple[str, ...] = ()) -> dict:
    """The artifact reloaded (`model`, its format's load: quantkit.formats.gate.load_artifact): every tower
    tensor checked bit-identical to the source and an image+text forward run; the report fields, or
    TowerChangedError (exit 3)."""
    identical, rounded, bad = tower_differences(model, info, quantized_roles)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise TowerChangedError(f"{len(bad)} of {identical + rounded + len(bad)} tower/projector tensors changed "
                                f"after reload: {', '.join(bad[:3])}{more}",
                                hint="a VLM tower was quantized or renamed; nothing was written")
    return {"tower_tensors_identical": identical, "tower_weights_quantized": rounded,
            "image_forward": image_forward(model, artifact)}


def mmproj_expected(piece, source):
    """The bytes the converter stores for one mmproj tensor, computed with torch from the source tensor."""
    import torch

    from quantkit.gguf.mixture import T

    data = source if source.dtype == torch.float16 else source.float()  # the converter keeps f16, else f32
    if piece.heads:  # LlamaModel.permute: each head's rotate_half halves interleaved
        n = piece.heads
        data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
    if piece.rule.split == "rows":
        n = data.shape[0] // 3
        data = data[piece.part * n:(piece.part + 1) * n]
    elif piece.rule.split == "time":
        data = data[:, :, piece.part]
    elif piece.rule.split == "token":  # one embedding row, read as such
        data = data[0]
    elif piece.rule.split == "patch_hwc":  # Gemma 4: (height, width, channel) columns as a Conv2D kernel
        data = data.reshape(data.shape[0], piece.shape[2], piece.shape[3], 3).permute(0, 3, 1, 2)
    data = data.reshape(piece.shape)  # a scalar (Gemma 4's clipping bounds) as one element
    if piece.rule.shift:
        data = data + 1
    cast = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[piece.qtype]
    return data.to(cast).contiguous(), data.float()


def prove_mmproj(mmproj: Path, info: ModelInfo, mmproj_type: str = "auto") -> dict:
    """Check the written mmproj against the source towers (see the module docstring); the report
    fields, or TowerChangedError (exit 3)."""
    import numpy as np
    import torch

    from quantkit.gguf.loader import open_reader
    from quantkit.gguf.mmproj import plan

    planned = plan(info.path, mmproj_type)
    stored = {t.name: t for t in open_reader(mmproj).tensors}
    written = {p.source for p in planned.pieces}
    towers = source_tower_tensors(info)
    bad = [f"{n} (not in {mmproj.name})" for n in towers if n not in written and n not in planned.dropped]
    bad += [f"{n} (unexpected)" for n in sorted(set(stored) - {p.name for p in planned.pieces})]
    exact, rounded, shifted = 0, [], []
    source_name, source = None, None
    for piece in planned.pieces:  # one source tensor in memory at a time (split parts are adjacent)
        if piece.source != source_name:
            source_name, source = piece.source, read_piece_source(info, piece)
        tensor = stored.get(piece.name)
        expected, unrounded = mmproj_expected(piece, source)
        if tensor is None:
            bad.append(f"{piece.name} (missing)")
            continue
        if tensor.tensor_type.name != piece.qtype.name or bytes(np.asarray(tensor.data).tobytes()) != \
                expected.view(torch.uint8).numpy().tobytes():
            bad.append(f"{piece.name} <- {piece.source} ({tensor.tensor_type.name}, bytes differ)")
        elif piece.rule.shift:
            shifted.append(piece.name)
        elif torch.equal(expected.float(), unrounded):
            exact += 1
        else:
            rounded.append(piece.name)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise TowerChangedError(f"{len(bad)} mmproj tensors differ from the source towers: {', '.join(bad[:3])}{more}",
                                hint="the mmproj .gguf does not hold the source's vision tower; nothing was written")
    return {"mmproj": mmproj.name, "converter": f"llama.cpp {planned.converter}", "tensors": len(planned.pieces),
            "tower_tensors_covered": len(towers), "source_values_exact": exact,
            "rounded_to_stored_type": rounded, "stored_plus_one": shifted, "left_out": planned.dropped,
            "image_forward": "skipped: a .gguf VLM runs in llama.cpp (llama-mtmd-cli -m MODEL --mmproj MMPROJ)"}
