"""quantkit.eval.artifacts: compressed-tensors artifacts are measured one decompressed module at a time,
with the same logits as transformers' whole-model decompression."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.eval import artifacts
from quantkit.formats.gate import load_artifact

METHOD_ARGS = {
    "fp8": ["--method", "fp8"],
    "gptq": ["--method", "gptq", "--num-samples", "16", "--seq-len", "64"],
}


@pytest.fixture(scope="module", params=["fp8", pytest.param("gptq", marks=pytest.mark.slow)])
def compressed(request, cli, micro_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / request.param
    result = cli("quantize", str(micro_model), "-o", str(out), "--eval-windows", "0", *METHOD_ARGS[request.param])
    assert result.exit_code == 0, result.output
    return out


def quantized_modules(model) -> list:
    from compressed_tensors.quantization.utils import is_module_quantized

    return [m for m in model.modules() if is_module_quantized(m)]


def test_per_module_decompression_gives_the_same_logits(compressed, monkeypatch):
    from compressed_tensors.quantization import QuantizationStatus

    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    lazy = load_artifact(compressed)
    monkeypatch.setattr(artifacts, "decompress_per_module", lambda model: None)
    whole = load_artifact(compressed)  # transformers' hook: the whole model on the first forward
    with torch.no_grad():
        expected, got, again = whole(input_ids=ids).logits, lazy(input_ids=ids).logits, lazy(input_ids=ids).logits
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert {m.quantization_status for m in quantized_modules(lazy)} == {QuantizationStatus.COMPRESSED}
    assert {m.quantization_status for m in quantized_modules(whole)} == {QuantizationStatus.DECOMPRESSED}


def test_one_module_is_decompressed_at_a_time(compressed):
    from compressed_tensors.quantization import QuantizationStatus

    model = load_artifact(compressed)
    modules, most = quantized_modules(model), [0]

    def count(_module, _args):
        most[0] = max(most[0], sum(m.quantization_status == QuantizationStatus.DECOMPRESSED for m in modules))

    handles = [m.register_forward_pre_hook(count) for m in modules]  # after quantkit's decompressing pre-hook
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    for h in handles:
        h.remove()
    assert len(modules) > 2 and most[0] == 1
