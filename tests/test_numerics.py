"""The streamed NaN/Inf scan of input weights."""

from __future__ import annotations

import pytest

from quantkit.errors import ModelError
from quantkit.io.numerics import check_finite, nonfinite_tensors

DTYPES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_counts_nan_and_inf_in_every_float_dtype(tmp_path, dtype):
    import torch
    from safetensors.torch import save_file

    values = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), 0.0, -2.5, 240.0, 1e-3])
    bad = values.to(getattr(torch, dtype))
    expected = int((~torch.isfinite(bad.float())).sum())
    save_file({"a.clean": torch.ones(3, 5, dtype=bad.dtype), "b.bad": bad, "c.ints": torch.arange(4)},
              str(tmp_path / "w.safetensors"))
    assert list(nonfinite_tensors(tmp_path / "w.safetensors")) == [("b.bad", expected)]


def test_large_finite_values_are_not_flagged(tmp_path):
    import torch
    from safetensors.torch import save_file

    big = torch.tensor([3.0e38, -3.3e38, 65504.0, 448.0])
    save_file({"f32": big, "bf16": big.bfloat16(), "f16": big[2:].half(), "e4m3": big[3:].to(torch.float8_e4m3fn)},
              str(tmp_path / "w.safetensors"))
    assert list(nonfinite_tensors(tmp_path / "w.safetensors")) == []


def test_scan_is_chunked(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    from quantkit.io import numerics

    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 7)
    t = torch.zeros(100, dtype=torch.bfloat16)
    t[[3, 50, 99]] = float("nan")
    save_file({"t": t}, str(tmp_path / "w.safetensors"))
    assert list(nonfinite_tensors(tmp_path / "w.safetensors")) == [("t", 3)]


def test_check_finite_names_tensor_and_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"ok": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    save_file({"layer.weight": torch.tensor([1.0, float("inf")])}, str(tmp_path / "b.safetensors"))
    check_finite([tmp_path / "a.safetensors"])
    with pytest.raises(ModelError, match=r"b\.safetensors: tensor layer\.weight holds 1 NaN/Inf"):
        check_finite([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
