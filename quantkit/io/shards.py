"""Write safetensors checkpoints a piece at a time: bounded shards, each tensor written in place.

A safetensors file is an 8-byte header length, a JSON header giving every tensor's dtype, shape and
byte range, then the data. When every tensor's dtype and shape are known before any data exists
(quantkit.engines.llmcompressor.model_free plans its output on the meta device first), the header can be
written first and each tensor's bytes put at their offset as they are produced: a row range of a
tensor with `write`, or a tensor of another file copied by the kernel with `copy`. Nothing needs
the whole shard, or even a whole tensor, in memory.

The files are what `safetensors.torch.save_file` writes (header padded with spaces to a multiple of
8 bytes, `__metadata__: {"format": "pt"}`), named as transformers names them: one shard is
`model.safetensors`; several are `model-0000i-of-0000n.safetensors` with a
`model.safetensors.index.json` mapping each tensor to its file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import InternalError
from quantkit.io.rowio import page_out
from quantkit.io.safetensors import DTYPE_BYTES, TORCH_DTYPES

SHARD_BYTES = 512 * 1024 * 1024  # data bytes per output shard (a tensor larger than this gets a shard of its own)
COPY_BYTES = 64 * 1024 * 1024  # one os.sendfile call when copying a stored tensor
PT_METADATA = (("format", "pt"),)  # the header's __metadata__ of a torch checkpoint
SAFETENSORS_DTYPES = {name: dtype for dtype, name in TORCH_DTYPES.items()}  # torch dtype name -> safetensors dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the output: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ShardLayout:
    """One output file: its header and where each tensor's data starts (absolute file offsets)."""

    file: str
    header: bytes  # the 8-byte length and the padded JSON header
    offsets: dict[str, int]
    specs: dict[str, TensorSpec]

    @property
    def size(self) -> int:
        return len(self.header) + sum(s.nbytes for s in self.specs.values())


def safetensors_dtype(dtype) -> str:
    """The safetensors name of a torch dtype (torch.bfloat16 -> "BF16")."""
    return SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")]


def group_shards(units: list[list[TensorSpec]], max_bytes: int = SHARD_BYTES) -> list[list[TensorSpec]]:
    """Consecutive units (tensors that stay in one file: a weight and its scale) in shards of at most
    max_bytes of data; a unit larger than that gets a shard of its own."""
    groups: list[list[TensorSpec]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(spec.nbytes for spec in unit)
        if not groups or (groups[-1] and size + unit_bytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += unit_bytes
    return groups


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The header of a file holding `specs` in this order, and each tensor's data offset in the file
    (`__metadata__`: `metadata`, by default {"format": "pt"}; none when it is empty)."""
    metadata = dict(PT_METADATA) if metadata is None else metadata
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    relative, position = {}, 0
    for spec in specs:
        entries[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                              "data_offsets": [position, position + spec.nbytes]}
        relative[spec.name] = position
        position += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    return head, {name: len(head) + offset for name, offset in relative.items()}


def layout_shards(units: list[list[TensorSpec]], max_bytes: int = SHARD_BYTES) -> list[ShardLayout]:
    """The files for `units` in order: names, headers and offsets, before any data is written."""
    groups = group_shards(units, max_bytes)
    layouts = []
    for name, group in zip(shard_file_names(len(groups)), groups):
        head, offsets = header_bytes(group)
        layouts.append(ShardLayout(name, head, offsets, {s.name: s for s in group}))
    return layouts


@dataclass
class ShardWriter:
    """An output shard being filled: its header is on disk, each tensor's bytes are written at their
    offset (in any order, a row range at a time); `close` checks every byte was written."""

    layout: ShardLayout
    path: Path
    fd: int = -1
    written: dict[str, int] = field(default_factory=dict)

    def __enter__(self) -> "ShardWriter":
        from quantkit.io.rowio import pwrite_all

        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.layout.size)
        pwrite_all(self.fd, memoryview(self.layout.header), 0)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        os.close(self.fd)
        if exc_type is None:
            self.check_complete()

    def write(self, name: str, data: memoryview, start: int = 0) -> None:
        """Bytes of tensor `name` from byte `start` of its data (a row range, or all of it)."""
        from quantkit.io.rowio import pwrite_all

        spec = self.layout.specs[name]
        if start + len(data) > spec.nbytes:
            raise InternalError(f"{name}: {start + len(data)} bytes written into a {spec.nbytes}-byte tensor")
        pwrite_all(self.fd, data, self.layout.offsets[name] + start)
        self.written[name] = self.written.get(name, 0) + len(data)

    def copy(self, name: str, source: Path, offset: int) -> None:
        """Tensor `name` copied whole from `source` at byte `offset` (the kernel moves the bytes; none
        pass through this process's memory)."""
        size = self.layout.specs[name].nbytes
        with open(source, "rb") as fh:
            done = 0
            while done < size:
                os.lseek(self.fd, self.layout.offsets[name] + done, os.SEEK_SET)
                sent = os.sendfile(self.fd, fh.fileno(), offset + done, min(COPY_BYTES, size - done))
                if sent == 0:
                    raise InternalError(f"{source.name}: file ends inside the data of {name}")
                done += sent
        self.written[name] = self.written.get(name, 0) + size

    def check_complete(self) -> None:
        short = [n for n, s in self.layout.specs.items() if self.written.get(n, 0) != s.nbytes]
        if short:
            raise InternalError(f"{self.path.name}: tensors not written in full: {short[:3]}")


# safetensors orders a file's tensors by dtype, wider first (DTYPE_BYTES) and then by its Dtype enum
# from the last (the order below), then by name; its Rust writer sorts that way before laying out the data.
DTYPE_ENUM = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")


def save_file(tensors: dict, path: Path, metadata: dict[str, str] | None = None, release_source: bool = True) -> None:
    """What `safetensors.torch.save_file` writes (byte for byte when the metadata has one key), put
    on disk with plain writes a tensor at a time. safetensors maps the output file while it fills it,
    so the whole file's pages count in the process's RSS until it is closed; written here they are
    page cache, and the pages of each tensor are handed back once written (rowio.page_out: a tensor
    transformers reads from a memory-mapped checkpoint would otherwise stay resident). What
    safetensors refuses (a non-contiguous tensor, tensors sharing memory) and dtypes outside
    DTYPE_ENUM go to safetensors itself. `release_source=False` skips the hand-back, for tensors that
    are fresh temporaries (with swap, their anonymous pages would be written out for nothing)."""
    import torch
    from safetensors.torch import save_file as safetensors_save_file

    codes = {name: SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}
    storages = [t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()]
    if (not set(codes.values()) <= set(DTYPE_ENUM) or len(set(storages)) < len(storages)
            or not all(t.is_contiguous() for t in tensors.values())):
        return safetensors_save_file(tensors, str(path), metadata=metadata)
    order = sorted(tensors, key=lambda n: (-DTYPE_BYTES[codes[n]], -DTYPE_ENUM.index(codes[n]), n))
    specs = [TensorSpec(name, codes[name], tuple(tensors[name].shape)) for name in order]
    head, offsets = header_bytes(specs, metadata or {})
    layout = ShardLayout(Path(path).name, head, offsets, {spec.name: spec for spec in specs})
    with ShardWriter(layout, Path(path)) as writer:
        for name in order:
            data = tensors[name].detach().to("cpu").reshape(-1).view(torch.uint8)
            for start in range(0, data.numel(), COPY_BYTES):
                chunk = data[start:start + COPY_BYTES]
                writer.write(name, memoryview(chunk.numpy()), start)
                if release_source:
                    page_out(chunk.data_ptr(), chunk.numel())  # a table read from the checkpoint's map


def save_temporaries(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """save_file for the disk offload's updates: each tensor is a fresh copy about to be dropped."""
    save_file(tensors, path, metadata, release_source=False)


def write_index(out_dir: Path, layouts: list[ShardLayout]) -> None:
    """model.safetensors.index.json for a checkpoint of several shards (none for a single file)."""
    if len(layouts) < 2:
        return
    from compressed_tensors.utils.safetensors_load import update_safetensors_index

    total = sum(s.nbytes for layout in layouts for s in layout.specs.values())
    update_safetensors_index(str(out_dir), total, {name: layout.file for layout in layouts for name in layout.specs})
