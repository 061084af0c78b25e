"""quantkit.io.shards: safetensors files written header first and filled tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.errors import InternalError
from quantkit.io.safetensors import safetensors_index, tensor_bytes
from quantkit.io.shards import (
    ShardWriter,
    TensorSpec,
    group_shards,
    layout_shards,
    safetensors_dtype,
    shard_file_names,
    write_index,
)


def spec(name: str, tensor) -> TensorSpec:
    return TensorSpec(name, safetensors_dtype(tensor.dtype), tuple(tensor.shape))


def test_units_stay_together_and_shards_stay_under_the_limit():
    a, b, c = (TensorSpec(n, "BF16", (64,)) for n in "abc")  # 128 bytes each
    big = TensorSpec("big", "F32", (1000,))
    groups = group_shards([[a, b], [c], [big], [a]], max_bytes=300)
    assert [[s.name for s in g] for g in groups] == [["a", "b"], ["c"], ["big"], ["a"]]
    assert [[s.name for s in g] for g in group_shards([[a], [b], [c]], max_bytes=300)] == [["a", "b"], ["c"]]
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_a_file_filled_out_of_order_reads_back_as_save_file_writes_it(tmp_path):
    tensors = {"w": torch.randn(5, 3).to(torch.bfloat16), "s": torch.randn(5, 1).to(torch.float8_e4m3fn),
               "n": torch.arange(7, dtype=torch.int64)}
    save_file({"stored": tensors["n"]}, tmp_path / "source.safetensors")
    stored = safetensors_index(tmp_path / "source.safetensors")["stored"]
    (layout,) = layout_shards([[spec(k, v) for k, v in tensors.items()]])
    assert len(layout.header) % 8 == 0
    with ShardWriter(layout, tmp_path / layout.file) as writer:
        writer.write("s", tensor_bytes(tensors["s"]))
        writer.write("w", tensor_bytes(tensors["w"][2:]), start=2 * 3 * 2)  # rows 2.. then rows 0..1
        writer.write("w", tensor_bytes(tensors["w"][:2]))
        writer.copy("n", stored.file, stored.offset)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert f.get_tensor(name).dtype == tensor.dtype
            assert torch.equal(f.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8))


def test_an_unfinished_file_is_an_internal_error(tmp_path):
    (layout,) = layout_shards([[TensorSpec("w", "F32", (4,))]])
    with pytest.raises(InternalError, match="not written in full"):
        with ShardWriter(layout, tmp_path / layout.file) as writer:
            writer.write("w", tensor_bytes(torch.zeros(2)))
    with pytest.raises(InternalError, match="bytes written into"):
        with ShardWriter(layout, tmp_path / layout.file) as writer:
            writer.write("w", tensor_bytes(torch.zeros(4)), start=4)


def test_the_index_names_every_tensor_of_several_shards(tmp_path):
    layouts = layout_shards([[TensorSpec("a", "F32", (4,))], [TensorSpec("b", "F32", (4,))]], max_bytes=16)
    write_index(tmp_path, layouts)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == 32
    write_index(tmp_path / "none", layouts[:1])  # one file: no index (the directory need not exist)


def mixed_tensors() -> dict:
    torch.manual_seed(0)
    return {"layer.b.weight": torch.randn(3, 5).to(torch.bfloat16), "layer.a.weight": torch.randn(7).to(torch.bfloat16),
            "packed": torch.randint(-9, 9, (4, 2), dtype=torch.int32), "scale": torch.rand(3),
            "g_idx": torch.arange(6), "half": torch.randn(2, 2).half(), "fp8": torch.randn(5).to(torch.float8_e4m3fn),
            "fp8b": torch.randn(1).to(torch.float8_e5m2), "mask": torch.tensor([True, False]),
            "i8": torch.tensor([-3, 4], dtype=torch.int8), "u8": torch.tensor([200], dtype=torch.uint8),
            "i16": torch.tensor([7], dtype=torch.int16), "f64": torch.tensor([1.5], dtype=torch.float64),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.0)}


def test_save_file_writes_what_safetensors_writes(tmp_path):
    """Byte for byte for {"format": "pt"}, as transformers passes it: every dtype, tensor order, strides, empties."""
    from quantkit.io.shards import save_file as plain_save_file

    tensors = mixed_tensors()
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    plain_save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "note": "x"}])
def test_save_file_round_trips_with_any_metadata(tmp_path, metadata):
    from safetensors.torch import load_file

    from quantkit.io.shards import save_file as plain_save_file

    tensors = mixed_tensors()
    plain_save_file(tensors, tmp_path / "ours.safetensors", metadata=metadata)
    loaded = load_file(tmp_path / "ours.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k].view(torch.uint8) if loaded[k].dtype.is_floating_point and loaded[k].element_size() == 1
                           else loaded[k], tensors[k].view(torch.uint8) if tensors[k].dtype.is_floating_point
                           and tensors[k].element_size() == 1 else tensors[k]) for k in tensors)
    with safe_open(tmp_path / "ours.safetensors", "pt") as fh:
        assert fh.metadata() == metadata


def test_save_file_leaves_dtypes_it_does_not_order_to_safetensors(tmp_path):
    """Other dtypes are written by safetensors, and what it refuses it still refuses."""
    from quantkit.io.shards import save_file as plain_save_file

    strided, whole = torch.randn(4, 6).t(), torch.randn(8)
    for bad in ({"strided": strided}, {"a": whole, "b": whole[:4]}):
        with pytest.raises((ValueError, RuntimeError)):
            plain_save_file(bad, tmp_path / "bad.safetensors", metadata={"format": "pt"})

    tensors = {"a": torch.tensor([1, 2], dtype=torch.uint32), "b": torch.ones(2)}
    plain_save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


SAFETENSORS_SAVE_SITE = ("transformers.modeling_utils", "safe_save_file")
OFFLOAD_SAVE_SITE = ("compressed_tensors.offload.cache.disk", "save_file")


def test_the_transformers_save_site_exists():
    from quantkit.engines.patches import PATCHES, site_function

    assert PATCHES["transformers.safe_save_file"].site == SAFETENSORS_SAVE_SITE
    assert site_function(SAFETENSORS_SAVE_SITE) is save_file


def test_the_offload_save_site_exists_and_is_swapped_inside_plain_writes():
    from quantkit.engines.patches import PATCHES, plain_writes, site_function
    from quantkit.io.shards import save_file as plain_save_file
    from quantkit.io.shards import save_temporaries

    assert PATCHES["compressed_tensors.disk_save_file"].site == OFFLOAD_SAVE_SITE

    original = site_function(OFFLOAD_SAVE_SITE)
    assert original is save_file
    with plain_writes():
        assert site_function(OFFLOAD_SAVE_SITE) is save_temporaries
        assert site_function(SAFETENSORS_SAVE_SITE) is plain_save_file
    assert site_function(OFFLOAD_SAVE_SITE) is original


def test_the_offload_writes_are_the_same_bytes(tmp_path):
    from quantkit.io.shards import save_temporaries

    tensors = {"weight": torch.randn(64, 48).to(torch.bfloat16)}
    save_temporaries(tensors, tmp_path / "ours.safetensors")
    save_file(tensors, tmp_path / "theirs.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
