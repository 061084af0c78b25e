"""imatrix: values equal a direct computation; GGUF write/read round trip; legacy .dat; llama.cpp reads ours."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from quantkit.gguf import imatrix as im


@pytest.fixture(scope="module")
def model_and_windows(micro):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro, dtype=torch.float32).eval()
    windows = torch.randint(0, 500, (3, 32), generator=torch.Generator().manual_seed(1))
    return model, windows


def test_values_equal_direct_computation(model_and_windows):
    import torch

    model, windows = model_and_windows
    result = im.compute(model, windows, model.config.to_dict())
    n_layer = model.config.num_hidden_layers
    expected = {f"blk.{i}.{t}.weight" for i in range(n_layer)
                for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(result.sums) == expected  # decoder matmuls only (no output.weight, as llama-imatrix)
    with torch.no_grad():
        hidden = model(input_ids=windows, output_hidden_states=True).hidden_states
    for i, layer in enumerate(model.model.layers):
        with torch.no_grad():
            x = layer.input_layernorm(hidden[i]).reshape(-1, model.config.hidden_size).double()
        direct = (x * x).sum(0).float().numpy()
        for t in ("attn_q", "attn_k", "attn_v"):
            np.testing.assert_allclose(result.sums[f"blk.{i}.{t}.weight"][0], direct, rtol=1e-5)
            assert result.counts[f"blk.{i}.{t}.weight"][0] == windows.numel()
    weights = result.weights()["blk.0.attn_q.weight"]
    np.testing.assert_array_equal(weights, result.sums["blk.0.attn_q.weight"][0] / np.float32(windows.numel()))


def test_gguf_round_trip(model_and_windows, tmp_path):
    import gguf

    model, windows = model_and_windows
    result = im.compute(model, windows, model.config.to_dict(), dataset="unit")
    path = im.write(result, tmp_path / "imatrix.gguf")
    back = im.read(path)
    assert set(back.sums) == set(result.sums)
    for name in result.sums:
        np.testing.assert_array_equal(back.sums[name], result.sums[name])
        np.testing.assert_array_equal(back.counts[name], result.counts[name])
    assert back.datasets == ["unit"] and back.chunk_count == 3 and back.chunk_size == 32
    reader = gguf.GGUFReader(str(path))
    assert reader.get_field("general.type").contents() == "imatrix"
    t = {x.name: x for x in reader.tensors}["blk.0.attn_q.weight.in_sum2"]
    assert [int(d) for d in t.shape] == [model.config.hidden_size, 1]  # ggml ne = [ncols, nmat]


def test_legacy_dat(tmp_path):
    values = np.arange(1, 9, dtype=np.float32) * 3  # (sum/count) * ncall with ncall = 3
    name = b"blk.0.attn_q.weight"
    blob = struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 3, 8)
    blob += values.tobytes() + struct.pack("<i", 3) + struct.pack("<i", 4) + b"data"
    (tmp_path / "old.dat").write_bytes(blob)
    back = im.read(tmp_path / "old.dat")
    assert back.legacy and back.chunk_count == 3
    np.testing.assert_array_equal(back.weights()["blk.0.attn_q.weight"], np.arange(1, 9, dtype=np.float32))


def test_missing_file_is_input_error(tmp_path):
    from quantkit.errors import InputError

    with pytest.raises(InputError):
        im.read(tmp_path / "nope.gguf")


@pytest.mark.slow
def test_llama_quantize_uses_our_imatrix_bit_exact(micro_f16, tmp_path):
    """llama-quantize --imatrix <ours> gives the same bytes as quantkit with the same imatrix."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.gguf.helpers import convert_to, need_llama, run_quantize, tensor_bytes

    need_llama("llama-quantize")
    model = AutoModelForCausalLM.from_pretrained(micro_f16, dtype=torch.float32).eval()
    windows = torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(2))
    path = im.write(im.compute(model, windows, model.config.to_dict()), tmp_path / "imatrix.gguf")
    weights = im.read(path).weights()
    f16 = tmp_path / "f16.gguf"
    convert_to(micro_f16, f16, "F16")
    for gguf_type in ("Q2_K", "Q3_K_S", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        theirs, ours = tmp_path / f"theirs-{gguf_type}.gguf", tmp_path / f"ours-{gguf_type}.gguf"
        run_quantize(f16, theirs, gguf_type, imatrix=path)
        result = convert_to(micro_f16, ours, gguf_type, imatrix=weights)
        assert result.imatrix_tensors == 14
        a, b = tensor_bytes(theirs), tensor_bytes(ours)
        assert {n: v[0] for n, v in a.items()} == {n: v[0] for n, v in b.items()}
        for name in a:
            assert a[name][1] == b[name][1], f"{gguf_type} {name}: bytes differ"
