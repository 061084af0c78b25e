"""quantkit.engines.llmcompressor.lean_hessian: llm-compressor's GPTQ with the Hessian kept in place gives the same bits."""

from __future__ import annotations

import pytest
import torch

from quantkit.engines.llmcompressor import lean_hessian
from quantkit.engines.patches import LEAN_GPTQ, PATCHES, site_function

SITES = [PATCHES[name].site for name in LEAN_GPTQ]


def hessian(width: int, dead: tuple[int, ...] = (), seed: int = 0) -> torch.Tensor:
    """An accumulated-looking Hessian: X Xᵀ in float32 (not exactly symmetric bit for bit), columns in `dead` zero."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(width, 3 * width, generator=generator) * torch.linspace(0.1, 3.0, width).unsqueeze(1)
    x[list(dead)] = 0
    return x @ x.t()


@pytest.mark.parametrize("width", [7, 1024, 1500, 2100])
@pytest.mark.parametrize("slab", [lean_hessian.ERROR_SLAB, 1 << 18])  # the default; blocks of 256 rows
def test_transpose_and_permute_in_place(width, slab, monkeypatch):
    monkeypatch.setattr(lean_hessian, "ERROR_SLAB", slab)
    matrix = torch.randn(width, width)
    expected = matrix.t().clone()
    lean_hessian.transpose_in_place(matrix)
    assert torch.equal(matrix, expected)
    perm = torch.randperm(width)
    expected = matrix[:, perm][perm, :]
    lean_hessian.permute_square_in_place(matrix, perm)
    assert torch.equal(matrix, expected)


def test_sites_exist():
    for site in SITES:
        assert callable(site_function(site)), site


def test_guard_restores_the_originals():
    before = [site_function(site) for site in SITES]
    with lean_hessian.lean_hessians():
        inside = [site_function(site) for site in SITES]
    after = [site_function(site) for site in SITES]
    assert after == before and not set(inside) & set(before)


def quantize(weight, h, actorder, group_size, lean: bool):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group" if group_size else "channel",
                            group_size=group_size, actorder=actorder)
    rows = weight.reshape(weight.shape[0], -1, group_size) if group_size else weight.unsqueeze(-1)
    scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
    batch = (weight.clone().unsqueeze(0), h.clone().unsqueeze(0), scale.unsqueeze(0), zero.unsqueeze(0), None)
    if not lean:
        return quantize_weight(*batch, quant_args=args)
    with lean_hessian.lean_hessians():  # quantize_weight looks its helpers up in its module's globals
        return quantize_weight(*batch, quant_args=args)


@pytest.mark.parametrize("actorder, group_size, dead", [
    (None, 64, ()), ("static", 64, (3, 200)), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("weight", 128, ()), ("weight", 64, (5, 6)), ("static", None, ()))),
])
def test_quantize_weight_bit_identical(actorder, group_size, dead):
    torch.manual_seed(1)
    weight = torch.randn(96, 1280)
    h = hessian(1280, dead)
    expected = quantize(weight, h, actorder, group_size, lean=False)
    got = quantize(weight, h, actorder, group_size, lean=True)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def quantize_args(weight, actorder, group_size):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group" if group_size else "channel",
                            group_size=group_size, actorder=actorder)
    rows = weight.reshape(weight.shape[0], -1, group_size) if group_size else weight.unsqueeze(-1)
    scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
    return scale.unsqueeze(0), zero.unsqueeze(0), args


@pytest.mark.parametrize("actorder, group_size, dead, slab", [
    (None, 64, (), 1), ("weight", 128, (), 777), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("static", 64, (3, 200), 300_000), ("weight", 32, (5,), 1), ("static", None, (), 10**9),
        (None, None, (7,), 3000))),
])
def test_lean_quantize_weight_bit_identical_to_upstream(actorder, group_size, dead, slab, monkeypatch):
    """quantkit's quantize_weight (block error and inverse permutation by slabs of rows: the sizes here
    make slabs of 256 rows and a remainder, up to the whole weight) against llm-compressor's own, all
    helpers upstream."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight as upstream

    torch.manual_seed(3)
    weight = torch.randn(700, 640)
    h = hessian(640, dead, seed=4)
    scale, zero, args = quantize_args(weight, actorder, group_size)
    expected = upstream(weight.clone().unsqueeze(0), h.clone().unsqueeze(0), scale, zero, None, args, blocksize=64)
    monkeypatch.setattr(lean_hessian, "ERROR_SLAB", slab)
    hessians = h.clone().unsqueeze(0)
    got = lean_hessian.quantize_weight(weight.clone().unsqueeze(0), hessians, scale, zero, None, args, blocksize=64)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert hessians.untyped_storage().nbytes() == 0  # the factorized Hessian freed before the caller writes back


def test_several_modules_go_to_upstream_quantize_weight():
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight as upstream

    torch.manual_seed(5)
    weights = torch.randn(2, 16, 128)
    hessians = torch.stack([hessian(128, seed=1), hessian(128, seed=2)])
    scale, zero, args = quantize_args(weights[0], None, 32)
    scales, zeros = torch.cat([scale, scale]), torch.cat([zero, zero])
    expected = upstream(weights.clone(), hessians.clone(), scales, zeros, None, args)
    got = lean_hessian.quantize_weight(weights.clone(), hessians.clone(), scales, zeros, None, args)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_compress_module_list_is_called_once_per_batch():
    from types import SimpleNamespace

    calls = []
    wrapped = lean_hessian.one_batch_per_call(lambda self, batch: calls.append(list(batch)))
    modules = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4), torch.nn.Linear(16, 4)]
    wrapped(SimpleNamespace(batched_quantization=None, block_size=128), modules)
    assert calls == [[m] for m in modules]


def test_not_positive_definite_falls_back_to_rtn_as_upstream():
    torch.manual_seed(2)
    weight = torch.randn(32, 256)
    h = -torch.eye(256)  # cholesky fails: llm-compressor rounds to nearest and flags it
    expected = quantize(weight, h, None, 64, lean=False)
    got = quantize(weight, h, None, 64, lean=True)
    assert bool(got[2][0]) and all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("shape, dtype", [((2, 48, 1300), torch.bfloat16), ((48, 1300), torch.float32),
                                          ((1, 3, 16, 1100), torch.float32)])
@pytest.mark.parametrize("slab", [lean_hessian.ERROR_SLAB, 1 << 18])  # the default; blocks of 256 rows
def test_accumulate_hessian_matches_upstream_and_leaves_the_input_alone(shape, dtype, slab, monkeypatch):
    from llmcompressor.modifiers.gptq import helpers

    monkeypatch.setattr(lean_hessian, "ERROR_SLAB", slab)

    linear = torch.nn.Linear(shape[-1], 8, bias=False)
    inp = torch.randn(shape).to(dtype)
    kept = inp.clone()
    start = hessian(shape[-1])
    expected = helpers.accumulate_hessian(inp, linear, start.clone(), torch.tensor(3.0))
    got = lean_hessian.accumulate_hessian(inp, linear, start.clone(), torch.tensor(3.0))
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert torch.equal(inp, kept)


def test_prepare_batch_normalizes_in_place_and_matches_upstream():
    from llmcompressor.modifiers.gptq import helpers

    linear = torch.nn.Linear(300, 40, bias=False).requires_grad_(False)
    qparams = [{"scale": torch.rand(40, 5), "zero_point": torch.zeros(40, 5), "global_scale": None}]
    h = hessian(300)
    upstream = helpers.prepare_batch([linear], qparams, {linear: h.clone()}, {linear: torch.tensor(48.0)})
    own = {linear: h.clone()}
    got = lean_hessian.prepare_batch([linear], qparams, own, {linear: torch.tensor(48.0)})
    assert not own
    for a, b in zip(upstream, got):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.slow
def test_gptq_writes_the_same_tensors_as_with_llm_compressors_own_functions(cli, micro_model, tmp_path, monkeypatch):
    """Through the CLI (act-order static, the default): the artifact's tensors with the lean Hessians equal
    those of llm-compressor's unpatched GPTQ."""
    from contextlib import nullcontext

    from safetensors.torch import load_file

    calls, factorize = [], lean_hessian.factorize_hessian
    monkeypatch.setattr(lean_hessian, "factorize_hessian", lambda *args: calls.append(1) or factorize(*args))
    tensors = {}
    for name in ("lean", "upstream"):
        if name == "upstream":
            monkeypatch.setattr(lean_hessian, "lean_hessians", nullcontext)
        result = cli("quantize", micro_model, "--method", "gptq", "--group-size", "32", "-o", tmp_path / name,
                     "--eval-windows", "0", "--num-samples", "16", "--seq-len", "64")
        assert result.exit_code == 0, result.output
        tensors[name] = load_file(tmp_path / name / "model.safetensors")
    assert calls  # the lean run went through quantkit's functions
    assert tensors["lean"].keys() == tensors["upstream"].keys()
    assert all(torch.equal(tensors["lean"][k], tensors["upstream"][k]) for k in tensors["lean"])
