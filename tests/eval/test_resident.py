"""quantkit.eval.resident: the whole model on its device, windows batched, the same numbers as the
streamed forward for every kind quantkit reads itself (a checkpoint, a .gguf, a compressed-tensors
artifact, an mlx-lm directory), each tensor read once, and a run out of memory finished streamed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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
                                    pytest.param(["--method", "gptq", "--num-samples", "16", "--seq-len", "64"],
                                                 marks=pytest.mark.slow),
                                    pytest.param(["--method", "mlx", "--bits", "4"], marks=pytest.mark.slow)],
                         ids=["gguf", "fp8", "gptq", "mlx"])
def test_resident_artifact_equals_streamed(cli, micro_model, windows, streamed_baseline, method, tmp_path):
    out = tmp_path / "artifact"
    result = cli("quantize", micro_model, "-o", out, "--eval-windows", "0", *method)
    assert result.exit_code == 0, result.output
    assert gate.artifact_reading(out, micro_model) is not None  # read by quantkit, not loaded whole
    streamed = gate.evaluate_artifact(out, micro_model, windows, streamed_baseline)
    whole = gate.evaluate_artifact(out, micro_model, windows, streamed_baseline, placement=RESIDENT)
    assert_same_metrics(whole, streamed)
    assert whole.kld_mean > 0


@pytest.fixture(scope="module")
def gguf_artifact(micro_model, tmp_path_factory) -> Path:
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    out = tmp_path_factory.mktemp("resident-gguf") / "gguf"
    result = CliRunner().invoke(app, ["quantize", str(micro_model), "-o", str(out), "--eval-windows", "0", "--method",
                                      "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "none"])
    assert result.exit_code == 0, result.output
    return out


def test_a_float32_reading_leaves_large_tables_in_its_file(micro_model, gguf_artifact, windows, streamed_baseline,
                                                            monkeypatch):
    """A .gguf read resident in float32 whose vocabulary tables are larger than TABLES_HELD_BYTES keeps them in the
    file (the embedding's rows gathered, the head applied a slice of rows at a time): the metrics and the logits of
    the tables held whole."""
    held = gate.evaluate_artifact(gguf_artifact, micro_model, windows, streamed_baseline, placement=RESIDENT)
    reading = gate.artifact_reading(gguf_artifact, micro_model)
    held_logits = resident.resident_logits(scorers.resident_reading(reading, "cpu"), windows[:2])
    monkeypatch.setattr(resident, "TABLES_HELD_BYTES", 0)
    model = scorers.resident_reading(reading, "cpu")
    assert model.tables is not None and model.head.weight.is_meta
    assert model.model.get_input_embeddings().weight.is_meta
    in_file = gate.evaluate_artifact(gguf_artifact, micro_model, windows, streamed_baseline, placement=RESIDENT)
    assert_same_metrics(in_file, held)
    torch.testing.assert_close(resident.resident_logits(model, windows[:2]), held_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", ["micro", "gemma2"])
def test_a_methods_forward_leaves_the_tables_on_meta(request, model, windows):
    """A method's own forward of the decoder (an imatrix, column importances) resident: the embedding's rows
    gathered per batch and the head never read (a 262K-vocabulary table is not held whole), the same hidden
    states as the model read whole (Gemma 2: tied, a scaled embedding)."""
    reading = scorers.checkpoint_reading(request.getfixturevalue("micro_model" if model == "micro" else "gemma2"))
    whole = scorers.resident_reading(reading, "cpu")
    meta, source = reading.open()
    decoder = resident.forward_model(reading.config, source, meta.dtype, "cpu", room=2**30, model=meta)
    assert isinstance(decoder, resident.ResidentModel)
    assert decoder.model.get_input_embeddings().weight.is_meta and decoder.head.weight.is_meta
    assert not any(p.is_meta for n, p in decoder.model.named_parameters() if n not in resident.table_names(meta))
    with torch.inference_mode():
        assert torch.equal(stream.last_hidden(decoder, windows), stream.last_hidden(whole, windows))


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
    assert set(source.gets.values()) == {1} and not source.rows_read
    assert set(source.gets) == set(source.keys())  # tied or not, nothing else is read
    assert all(not p.is_meta for p in made[0].model.parameters())
    metrics = evaluate.compare_chunks(chunks, streamed_baseline)
    assert metrics.kld_mean < 1e-6 and metrics.top1 == 1.0


def test_logits_come_a_chunk_of_positions_at_a_time(micro_model, windows, monkeypatch):
    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 512 * 50)  # 50 positions of a 512 vocab
    monkeypatch.setattr(evaluate, "HEAD_BLOCK_BYTES", 2 * 512 * 70)  # the head's blocks: 70 positions in bfloat16
    chunks = list(scorers.base_scorer(checkpoint.check_model_dir(micro_model), placement=RESIDENT)(windows))
    sizes = [c.logprobs.shape[0] for c in chunks]
    assert max(sizes) == 50 and sizes[:2] == [50, 20]  # a block's log-softmax a chunk at a time
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
    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 512 * 50)
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


# ------------------------------------------------------------------ lockstep, chunks, nothing on disk


@pytest.fixture(scope="module")
def fp8_artifact(micro_model, tmp_path_factory) -> Path:
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    out = tmp_path_factory.mktemp("resident-fp8") / "fp8"
    result = CliRunner().invoke(app, ["quantize", str(micro_model), "-o", str(out), "--method", "fp8",
                                      "--eval-windows", "0"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


LOCKSTEP = scorers.Placement(True, spill=False, lockstep=True)


def direct_metrics(micro_model, artifact, windows) -> dict:
    """The gate's metrics computed independently: each model's whole logits from transformers' own forward,
    in float64, both log-probs rounded to float16 and renormalized (the protocol of evaluate.kl_rows)."""
    from transformers import AutoModelForCausalLM

    def logprobs(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
        with torch.inference_mode():
            return torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1).reshape(-1, 512)

    def rounded(lp):
        lp = lp.half().double().clamp_min(evaluate.FLOAT16_MIN)
        return lp - torch.logsumexp(lp, -1, keepdim=True)

    base, cand = logprobs(micro_model), logprobs(artifact)
    p, q = rounded(base), rounded(cand)
    targets = windows[:, 1:].reshape(-1, 1)
    nll = -cand.gather(1, targets).mean().item()
    return {"kld_mean": (p.exp() * (p - q)).sum(-1).clamp_min(0).mean().item(),
            "top1": (base.argmax(-1) == cand.argmax(-1)).double().mean().item(),
            "ppl": float(np.exp(nll)), "ppl_base": float(np.exp(-base.gather(1, targets).mean().item()))}


def test_chunked_logits_give_the_metrics_of_whole_logits(micro_model, fp8_artifact, windows, monkeypatch):
    """Chunks of 7 positions (crossing the 63-position windows), resident in lockstep and through a model object:
    the metrics of transformers' whole logits computed apart."""
    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 512 * 7)
    direct = direct_metrics(micro_model, fp8_artifact, windows)
    info = checkpoint.check_model_dir(micro_model)
    lockstep = gate.evaluate_artifact(fp8_artifact, micro_model, windows,
                                         scorers.base_baseline(info, windows, placement=LOCKSTEP), placement=LOCKSTEP)
    from quantkit.engines.transformers import load_model

    kept = evaluate.compute_baseline(evaluate.model_scorer(load_model(info)), windows)
    objects = evaluate.compare(evaluate.model_scorer(gate.load_artifact(fp8_artifact, micro_model)), windows, kept)
    for metrics in (lockstep, objects):
        assert metrics.kld_mean == pytest.approx(direct["kld_mean"], rel=2e-3)
        assert metrics.top1 == pytest.approx(direct["top1"], abs=1 / metrics.positions)
        assert metrics.ppl == pytest.approx(direct["ppl"], rel=1e-4)
        assert metrics.ppl_base == pytest.approx(direct["ppl_base"], rel=1e-4)
    assert direct["kld_mean"] > 0


def test_lockstep_holds_what_the_artifact_stores_unchanged_once(micro_model, fp8_artifact, windows):
    """The artifact's resident model takes the base's tensors where it stores the same values (fp8 keeps the
    embeddings, the head and the norms), compared a slice at a time, never read whole; its quantized layers
    are its own."""
    from quantkit.eval.resident import Shared

    info = checkpoint.check_model_dir(micro_model)
    base = scorers.resident_reading(scorers.base_reading(info), "cpu")
    shared = Shared(dict(base.model.named_parameters(remove_duplicate=False)))
    reading = gate.artifact_reading(fp8_artifact, micro_model)
    model, stored = reading.open()
    source = CountingSource(stored)
    artifact = resident.resident_built(model, reading.config, source, "cpu", shared.tensors)
    mine, theirs = dict(artifact.model.named_parameters()), dict(base.model.named_parameters())
    same = {name for name in mine if mine[name].data_ptr() == theirs[name].data_ptr()}
    assert "model.embed_tokens.weight" in same and "model.norm.weight" in same
    assert not any(".mlp." in name and name.endswith("proj.weight") for name in same)
    assert "model.embed_tokens.weight" not in source.gets  # compared by rows only


def test_a_lockstep_artifact_out_of_memory_finishes_streamed_with_the_same_metrics(micro_model, fp8_artifact, windows,
                                                                                   monkeypatch):
    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 512 * 50)
    info = checkpoint.check_model_dir(micro_model)
    reference = gate.evaluate_artifact(fp8_artifact, micro_model, windows,
                                          scorers.base_baseline(info, windows, placement=LOCKSTEP), placement=LOCKSTEP)
    real = resident.resident_scorer

    def failing(make, text_config, activation_bytes, lends=None):
        scorer = real(make, text_config, activation_bytes, lends)
        return scorer if lends is not None else failing_after(scorer, 3, MemoryError())

    monkeypatch.setattr(resident, "resident_scorer", failing)
    said = []
    metrics = gate.evaluate_artifact(fp8_artifact, micro_model, windows,
                                        scorers.base_baseline(info, windows, placement=LOCKSTEP), placement=LOCKSTEP,
                                        progress=said.append)
    assert any("ran out of memory" in line and "streaming the rest" in line for line in said)
    assert_same_metrics(metrics, reference)


def test_a_run_that_fits_writes_nothing_but_its_artifact(cli, micro_model, tmp_path, monkeypatch):
    """Resident by default: no spilled baseline or logits (no RowFile), no tables offloaded to disk, the
    placement line with its numbers."""
    import tempfile

    from quantkit.io import rowio

    made = []
    monkeypatch.setattr(rowio.RowFile, "__init__", lambda self, *a, **k: made.append(a) or pytest.fail("spilled"))
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(k) or real_mkdtemp(*a, **k))
    result = cli("quantize", micro_model, "-o", tmp_path / "out", "--method", "gptq", "--num-samples", "16",
                 "--seq-len", "64", "--eval-windows", "4", "--no-gate")
    assert result.exit_code == 0, result.output
    assert "gate: resident on cpu, batch 4" in result.stderr and "available now" in result.stderr
    assert "offloaded" not in result.stderr and "--max-memory" not in result.stderr
    assert not [k for k in made if "quantkit-offload-" in str(k.get("prefix"))]
