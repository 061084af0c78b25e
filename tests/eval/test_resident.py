"""quantkit.eval.resident: the whole model on its device, windows batched, the same numbers as the
streamed forward for every kind quantkit reads itself (a checkpoint, a .gguf, a compressed-tensors
artifact, an mlx-lm directory), each tensor read once, and a run out of memory finished streamed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.eval import evaluate, resident, scorers, stream
from quantkit.formats import gate
from quantkit.io import checkpoint
from tests.test_stream import CountingSource

REL = 1e-4
RESIDENT = scorers.Placement(True)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 500, (5, 64), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> Path:
    from tests.gguf.helpers import build_gemma

    return build_gemma(tmp_path_factory.mktemp("resident-gemma") / "gemma2", 2)


@pytest.fixture(scope="module")
def streamed_baseline(micro_model, windows):
    return evaluate.compute_baseline(scorers.checkpoint_scorer(micro_model), windows)


def assert_same_metrics(a: evaluate.Metrics, b: evaluate.Metrics) -> None:
    assert a.positions == b.positions
    for name in ("ppl_base", "ppl", "kld_mean", "kld_p99", "top1"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=REL, abs=1e-7), name


@pytest.mark.parametrize("model", ["micro", "gemma2"])
def test_resident_base_equals_streamed(request, model, windows):
    """The same modules in the same dtype: the resident baseline is the streamed one (Gemma 2: softcaps,
    a sliding window), and each scores the other as identical."""
    model_dir = request.getfixturevalue("micro_model" if model == "micro" else "gemma2")
    info = checkpoint.check_model_dir(model_dir)
    streamed = evaluate.compute_baseline(scorers.base_scorer(info), windows)
    whole = evaluate.compute_baseline(scorers.base_scorer(info, placement=RESIDENT), windows)
    assert whole.ppl == pytest.approx(streamed.ppl, rel=REL)
    assert (whole.top1 == streamed.top1).all() and (whole.targets == streamed.targets).all()
    metrics = evaluate.compare(scorers.base_scorer(info, placement=RESIDENT), windows, streamed)
    assert metrics.kld_mean < 1e-6 and metrics.top1 == 1.0


@pytest.mark.parametrize("method", [["--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "none"],
                                    ["--method", "fp8"],
                                    ["--method", "gptq", "--num-samples", "16", "--seq-len", "64"],
                                    ["--method", "mlx", "--bits", "4"]], ids=["gguf", "fp8", "gptq", "mlx"])
def test_resident_artifact_equals_streamed(cli, micro_model, windows, streamed_baseline, method, tmp_path):
    out = tmp_path / "artifact"
    result = cli("quantize", micro_model, "-o", out, "--eval-windows", "0", *method)
    assert result.exit_code == 0, result.output
    assert gate.artifact_reading(out, micro_model) is not None  # read by quantkit, not loaded whole
    streamed = gate.evaluate_artifact(out, micro_model, windows, streamed_baseline)
    whole = gate.evaluate_artifact(out, micro_model, windows, streamed_baseline, placement=RESIDENT)
    assert_same_metrics(whole, streamed)
    assert whole.kld_mean > 0


def test_each_tensor_is_read_once_whatever_the_batches(micro_model, windows, streamed_baseline):
    """One window per batch: still every tensor read once, whole, and the same log-probs."""
    reading = scorers.checkpoint_reading(micro_model)
    source = CountingSource(checkpoint.SafetensorsWeights(micro_model))
    made = []

    def make():
        made.append(resident.resident_built(reading.open()[0], reading.config, source, "cpu"))
        return made[-1]

    scorer = resident.resident_scorer(make, reading.config.get_text_config(), activation_bytes=1)
    chunks = list(scorer(windows))
    assert set(source.reads.values()) == {1} and not source.rows_read
    assert set(source.reads) == set(source.keys())  # tied or not, nothing else is read
    assert all(not p.is_meta for p in made[0].model.parameters())
    metrics = evaluate.compare_chunks(chunks, streamed_baseline)
    assert metrics.kld_mean < 1e-6 and metrics.top1 == 1.0


def test_logits_come_a_chunk_of_positions_at_a_time(micro_model, windows, monkeypatch):
    monkeypatch.setattr(resident, "CPU_CHUNK_BYTES", 4 * 512 * 50)  # 50 positions of a 512 vocab
    monkeypatch.setattr(resident, "MIN_CHUNK_POSITIONS", 1)
    chunks = list(scorers.base_scorer(checkpoint.check_model_dir(micro_model), placement=RESIDENT)(windows))
    assert max(c.logprobs.shape[0] for c in chunks) == 50
    assert sum(c.logprobs.shape[0] for c in chunks) == evaluate.positions(windows)
    assert torch.equal(torch.cat([c.targets for c in chunks]), windows[:, 1:].reshape(-1))


def test_resident_logits_equal_streamed_logits(micro_model, windows):
    info = checkpoint.check_model_dir(micro_model)
    whole = scorers.base_logits(info, placement=RESIDENT)(windows[:2])
    streamed = scorers.base_logits(info)(windows[:2])
    assert whole.shape == streamed.shape == (2, 64, 512)
    torch.testing.assert_close(whole, streamed, rtol=1e-3, atol=1e-3)


def failing_after(scorer, chunks: int, error: Exception):
    """`scorer`'s first `chunks` chunks, then `error`."""

    def fails(windows):
        for index, chunk in enumerate(scorer(windows)):
            if index == chunks:
                raise error
            yield chunk

    return fails


@pytest.mark.parametrize("chunks", [0, 1, 3, 6])
def test_out_of_memory_finishes_streamed(micro_model, windows, monkeypatch, chunks):
    """Chunks of 50 positions cross the 63-position windows: whatever chunk the failure comes after,
    the positions come once each, in order, and the metrics are the streamed ones."""
    monkeypatch.setattr(resident, "CPU_CHUNK_BYTES", 4 * 512 * 50)
    monkeypatch.setattr(resident, "MIN_CHUNK_POSITIONS", 1)
    info = checkpoint.check_model_dir(micro_model)
    streamed = scorers.base_scorer(info)
    whole = failing_after(scorers.base_scorer(info, placement=RESIDENT), chunks, torch.OutOfMemoryError("CUDA out of memory"))
    said = []
    out = list(resident.falling_back(whole, streamed, said.append)(windows))
    assert len(said) == 1 and "ran out of memory" in said[0] and "streaming" in said[0]
    assert torch.equal(torch.cat([c.targets for c in out]), windows[:, 1:].reshape(-1))
    reference = torch.cat([c.logprobs for c in streamed(windows)])
    torch.testing.assert_close(torch.cat([c.logprobs for c in out]), reference, rtol=1e-4, atol=1e-4)


def test_only_an_allocation_failure_falls_back(micro_model, windows):
    info = checkpoint.check_model_dir(micro_model)
    broken = failing_after(scorers.base_scorer(info, placement=RESIDENT), 0, ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        list(resident.falling_back(broken, scorers.base_scorer(info), print)(windows))
    assert resident.out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    assert resident.out_of_memory(MemoryError()) and not resident.out_of_memory(RuntimeError("shape mismatch"))


def test_the_meta_model_is_built_the_streamed_way(micro_model, monkeypatch):
    """The resident model is the streamed path's meta model with its weights placed: one builder."""
    built = []
    real = stream.build_meta_model
    monkeypatch.setattr(stream, "build_meta_model", lambda config, dtype: built.append(dtype) or real(config, dtype))
    reading = scorers.checkpoint_reading(micro_model)
    whole = scorers.resident_reading(reading, "cpu")
    assert built == [torch.bfloat16]
    assert {p.dtype for p in whole.model.parameters()} == {torch.bfloat16}
    from safetensors.torch import load_file  # the checkpoint's own tensors, read without quantkit

    stored = {name: tensor for f in sorted(micro_model.glob("*.safetensors")) for name, tensor in load_file(f).items()}
    placed = dict(whole.model.named_parameters())
    assert placed and all(not p.is_meta for p in placed.values())
    for name, param in placed.items():
        source = stored.get(name, stored.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        assert source is not None and torch.equal(param, source.to(param.dtype)), name
