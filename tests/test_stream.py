"""Layer-streamed forwards: the same metrics as the in-memory models, weights one unit at a time.

Models: the session's micro Llama (bf16 safetensors), a tiny Gemma 2 (final and attention
softcaps, 32-token sliding window under 64-token windows; built as the GGUF Gemma tests build
it), and .gguf candidates written by quantkit's converter, against today's load_gguf_into_base.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from quantkit.eval import evaluate, scorers, stream
from quantkit.formats import gate
from quantkit.io import checkpoint, memory
from quantkit.run.recipe import Gate

REL = 1e-4


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> Path:
    from tests.gguf.helpers import build_gemma

    return build_gemma(tmp_path_factory.mktemp("gguf-gemma") / "gemma2", 2)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 500, (5, 64), generator=torch.Generator().manual_seed(0))


_BASELINES: dict[Path, evaluate.Baseline] = {}  # per model, on the module's windows


def in_memory_baseline(model_dir: Path, windows):
    from quantkit.engines.transformers import load_model
    from quantkit.io.checkpoint import check_model_dir

    if model_dir not in _BASELINES:
        model = load_model(check_model_dir(model_dir))
        _BASELINES[model_dir] = evaluate.compute_baseline(evaluate.model_scorer(model), windows)
    return _BASELINES[model_dir]


def assert_same_metrics(a: evaluate.Metrics, b: evaluate.Metrics) -> None:
    assert a.positions == b.positions
    for name in ("ppl_base", "ppl", "kld_mean", "kld_p99", "top1"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=REL, abs=1e-7), name


class CountingSource:
    """A WeightSource that counts reads (whole tensors, and rows read by `rows`) and can poison one tensor."""

    def __init__(self, source, nan: str | None = None):
        self.source, self.nan, self.reads, self.rows_read = source, nan, {}, {}

    def keys(self):
        return self.source.keys()

    def shape(self, name):
        return self.source.shape(name)

    def get(self, name):
        self.reads[name] = self.reads.get(name, 0) + 1
        tensor = self.source.get(name)
        return torch.full_like(tensor, math.nan) if name == self.nan else tensor

    def rows(self, name, index):
        self.rows_read[name] = self.rows_read.get(name, 0) + len(index)
        tensor = self.source.rows(name, index)
        return torch.full_like(tensor, math.nan) if name == self.nan else tensor


def scorer_over(model_dir: Path, source, **kw) -> evaluate.Scorer:
    from transformers import AutoConfig

    from quantkit.engines.transformers import torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    dtype = torch_dtype("auto", check_model_dir(model_dir))
    return stream.streamed_scorer(AutoConfig.from_pretrained(model_dir), source, dtype, **kw)


@pytest.mark.parametrize("model", ["micro", "gemma2"])
def test_streamed_checkpoint_equals_in_memory(request, model, windows):
    model_dir = request.getfixturevalue("micro_model" if model == "micro" else "gemma2")
    base = in_memory_baseline(model_dir, windows)
    streamed = evaluate.compute_baseline(scorers.checkpoint_scorer(model_dir), windows)
    assert streamed.ppl == pytest.approx(base.ppl, rel=REL)
    assert (streamed.top1 == base.top1).all() and (streamed.targets == base.targets).all()
    metrics = evaluate.compare(gate.artifact_scorer(model_dir), windows, base)  # a plain checkpoint streams
    assert metrics.kld_mean < 1e-6 and metrics.top1 == 1.0 and abs(metrics.ppl_increase) < REL


@pytest.mark.parametrize("model,gguf_type", [("micro", "Q8_0"), ("micro", "Q4_K_M"), ("gemma2", "Q4_K_M")])
def test_streamed_gguf_equals_load_gguf_into_base(request, model, gguf_type, windows, tmp_path):
    from quantkit.eval.artifacts import load_gguf_into_base
    from quantkit.gguf.convert import convert

    model_dir = request.getfixturevalue("micro_model" if model == "micro" else "gemma2")
    path = tmp_path / f"{gguf_type}.gguf"
    convert(model_dir, path, gguf_type)
    base = in_memory_baseline(model_dir, windows)
    whole = evaluate.compare(evaluate.model_scorer(load_gguf_into_base(path, model_dir)), windows, base)
    streamed = evaluate.compare(gate.artifact_scorer(path, model_dir), windows, base)
    assert_same_metrics(streamed, whole)
    assert whole.kld_mean > 0


def test_layers_are_materialized_one_at_a_time(micro_model, windows, monkeypatch):
    """At every module's forward, the parameters off the meta device are one weight matrix at most;
    the embedding holds only the rows of the windows' distinct ids and the head is never a parameter."""
    built, peak = [], [0]
    real_build = stream.build_meta_model

    def capture(config, dtype):
        built.append(real_build(config, dtype))
        return built[-1]

    class Count(torch.overrides.TorchFunctionMode):  # at every torch call inside the forwards
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if built:
                peak[0] = max(peak[0], sum(p.numel() for p in built[0].parameters() if not p.is_meta))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(stream, "build_meta_model", capture)
    with Count():
        evaluate.compute_baseline(scorers.checkpoint_scorer(micro_model), windows)
    model = built[0]
    matrices = [p.numel() for p in model.get_decoder().layers.parameters()]
    embedding = len(windows.unique()) * model.config.hidden_size
    assert peak[0] == max(matrices + [embedding])
    assert peak[0] < sum(p.numel() for p in model.get_decoder().layers[0].parameters()) / 2
    assert all(not p.is_meta for p in model.get_decoder().rotary_emb.buffers())
    assert all(p.is_meta for p in model.parameters())  # everything freed afterwards


def test_each_tensor_is_read_once_per_group_of_windows(micro_model, windows):
    """Layers are read whole once per group; the head's rows once each per group; the embedding's
    only for the ids that occur."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    source = CountingSource(checkpoint.SafetensorsWeights(micro_model))
    evaluate.compute_baseline(scorer_over(micro_model, source), windows)
    assert set(source.reads.values()) == {1}
    assert set(source.reads) | set(source.rows_read) == set(source.keys())
    vocab = source.shape(head)[0]
    assert source.rows_read == {embed: len(windows.unique()), head: vocab}
    one_window = CountingSource(checkpoint.SafetensorsWeights(micro_model))
    baseline = evaluate.compute_baseline(scorer_over(micro_model, one_window, activation_bytes=1), windows)
    assert set(one_window.reads.values()) == {len(windows)}
    assert one_window.rows_read[head] == vocab * len(windows)
    assert one_window.rows_read[embed] == sum(len(w.unique()) for w in windows)
    assert baseline.ppl == pytest.approx(in_memory_baseline(micro_model, windows).ppl, rel=REL)


def test_head_in_many_vocabulary_slices_gives_the_same_metrics(micro_model, windows, monkeypatch, tmp_path):
    base = in_memory_baseline(micro_model, windows)
    monkeypatch.setattr(stream, "HEAD_SLICE_BYTES", 4 * 64 * 7)  # 7 rows of the 64-wide head per slice
    assert stream.head_slice_rows(10, 64) == 7
    metrics = evaluate.compare(scorers.checkpoint_scorer(micro_model, workdir=tmp_path), windows, base)
    assert metrics.kld_mean < 1e-6 and metrics.top1 == 1.0 and abs(metrics.ppl_increase) < REL
    assert not list(tmp_path.iterdir())  # the spilled logits' file is unlinked at once


def test_logits_come_a_chunk_of_positions_at_a_time(micro_model, windows, monkeypatch):
    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 512 * 50)  # 50 positions of a 512 vocab
    chunks = list(scorers.checkpoint_scorer(micro_model)(windows))
    assert max(c.logprobs.shape[0] for c in chunks) == 50
    assert sum(c.logprobs.shape[0] for c in chunks) == evaluate.positions(windows)
    assert torch.equal(torch.cat([c.targets for c in chunks]), windows[:, 1:].reshape(-1))


def test_nan_weights_score_no_agreement_and_fail_an_unenforced_gate(micro_model, windows):
    base = in_memory_baseline(micro_model, windows)
    poisoned = CountingSource(checkpoint.SafetensorsWeights(micro_model), nan="model.norm.weight")
    metrics = evaluate.compare(scorer_over(micro_model, poisoned), windows, base)
    assert metrics.top1 == 0.0 and math.isnan(metrics.kld_mean) and math.isnan(metrics.ppl)
    verdict = evaluate.gate_verdict(metrics, Gate(), enforced=False)
    assert not verdict.passed and verdict.enforced and "finite" in verdict.failed


def test_missing_tensor_is_a_model_error(micro_model, windows):
    from quantkit.errors import ModelError

    class Lacking(CountingSource):
        def keys(self):
            return [k for k in self.source.keys() if "layers.1.mlp" not in k]

    with pytest.raises(ModelError, match="layers.1.mlp"):
        list(scorer_over(micro_model, Lacking(checkpoint.SafetensorsWeights(micro_model)))(windows))


def test_safetensors_source_reads_stored_dtype(micro_model):
    from safetensors.torch import load_file

    source = checkpoint.SafetensorsWeights(micro_model)
    ref = load_file(micro_model / "model.safetensors")
    assert set(source.keys()) == set(ref)
    for name, tensor in ref.items():
        got = source.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_safetensors_rows_equal_the_tensors_rows(micro_model):
    import numpy as np

    source = checkpoint.SafetensorsWeights(micro_model)
    index = np.array([0, 1, 2, 7, 9, 10, 200, 499])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(source.rows(name, index), source.get(name)[index]), name
    assert source.rows("lm_head.weight", np.array([], dtype=np.int64)).shape[0] == 0


def test_gguf_rows_equal_the_dequantized_rows(micro_model, tmp_path):
    import numpy as np

    from quantkit.gguf.convert import convert
    from quantkit.gguf.loader import GGUFTensors
    from quantkit.io.checkpoint import read_config

    path = tmp_path / "q4.gguf"
    convert(micro_model, path, "Q4_K_M")
    source = GGUFTensors(path, read_config(micro_model))
    for name in source.keys():
        if len(source.shape(name)) == 2:
            index = np.array([0, 3, 4, 5, 100, 255]) % source.shape(name)[0]
            index = np.unique(index)
            assert torch.equal(source.rows(name, index), source.get(name)[index]), name


def test_gguf_tensors_dequantize_in_slabs_exactly(micro_model, tmp_path, monkeypatch):
    import gguf
    import numpy as np

    from quantkit.gguf import loader
    from quantkit.gguf.convert import convert

    path = tmp_path / "q4.gguf"
    convert(micro_model, path, "Q4_K_M")
    monkeypatch.setattr(loader, "SLAB_ELEMENTS", 256 * 3)  # 3 rows per slab
    for tensor in gguf.GGUFReader(str(path)).tensors:
        whole = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        sliced = loader.dequantize(tensor, loader.read_tensor_data(path, tensor))
        assert np.array_equal(sliced, whole), tensor.name


LARGE_BLOCKS_SCRIPT = """
import sys, torch
from quantkit.io.memory import LARGE_ALLOCATION, map_large_allocations
def rss_anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))
scratch = torch.ones(3 * LARGE_ALLOCATION // 8); del scratch  # glibc's threshold rises past 16 MiB, as in a long run
if sys.argv[1] == "mapped":
    map_large_allocations()
blocks, kept = [], []
for _ in range(6):  # each large block between two small ones that stay: the heap cannot shrink past them
    blocks.append(torch.ones(LARGE_ALLOCATION // 4))
    kept.append(torch.ones(1 << 18))
during = rss_anon()
del blocks
print(during - rss_anon())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists() or __import__("platform").libc_ver()[0] != "glibc",
                    reason="glibc on Linux only")
def test_large_allocations_go_back_to_the_os_when_freed():
    """map_large_allocations: blocks of LARGE_ALLOCATION bytes freed between live small ones leave the
    RSS (each had a memory map of its own); with glibc's rising default they stay in the heap."""
    import subprocess
    import sys

    def released(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", LARGE_BLOCKS_SCRIPT, mode], capture_output=True, text=True,
                             check=True)
        return int(run.stdout.split()[-1])

    assert released("mapped") >= 5 * memory.LARGE_ALLOCATION
    assert released("default") < released("mapped")


@pytest.mark.parametrize("family", ["micro", "gemma2", "phi3"])
def test_a_forward_started_at_a_layer_equals_the_whole_forward(request, family, windows, tmp_path):
    """The probes' forwards (quantkit.mixed.sensitivity.probe_klds) resume at a layer from its recorded input: with
    one weight changed in that layer, the logits equal the whole forward's with the same change. The change
    reverses the weight's rows: a scale alone would vanish behind Gemma 2's norms after each block."""
    from quantkit.engines.transformers import hf_config
    from quantkit.mixed.sensitivity import PatchedWeights

    if family in ("micro", "gemma2"):
        model_dir = request.getfixturevalue("micro_model" if family == "micro" else "gemma2")
    else:
        from tests.gguf.families import build_family

        model_dir = build_family(family, tmp_path / family)
    config = hf_config(model_dir)
    base = checkpoint.SafetensorsWeights(model_dir)
    streamed = stream.stream_model(config, base, torch.float32)
    text, record = config.get_text_config(), {}
    layers = text.num_hidden_layers
    baseline = evaluate.compute_baseline(stream.recording_scorer(streamed, text, {1, layers}, record), windows)
    name = next(n for n in base.keys() if n.startswith("model.layers.1.") and n.endswith("proj.weight"))
    streamed.weights.source = PatchedWeights(base, {name: base.get(name).float().flip(0)})
    whole = evaluate.compare(stream.start_scorer(streamed, text, 0, record), windows, baseline)
    resumed = evaluate.compare(stream.start_scorer(streamed, text, 1, record), windows, baseline)
    assert whole.kld_mean > 1e-6 and resumed.kld_mean == pytest.approx(whole.kld_mean, rel=1e-5)
    streamed.weights.source = base
    assert evaluate.compare(stream.start_scorer(streamed, text, layers, record), windows, baseline).kld_mean < 1e-9


def test_reading_the_next_layer_ahead_changes_nothing_but_the_timing(micro_model, windows, monkeypatch):
    """Forced on (it is a GPU's default): the same log-probs, every tensor still read once per group, and
    never more than one layer ahead of the forward."""
    from transformers import AutoConfig

    from quantkit.engines.transformers import torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    config, dtype = AutoConfig.from_pretrained(micro_model), torch_dtype("auto", check_model_dir(micro_model))
    plain = evaluate.compute_baseline(scorers.checkpoint_scorer(micro_model), windows)
    source = CountingSource(checkpoint.SafetensorsWeights(micro_model))
    built = []

    def make():
        built.append(stream.stream_built(stream.build_meta_model(config, dtype), config, source, "cpu", prefetch=True))
        return built[-1]

    ahead = []
    real_read = stream.PrefetchingSource.read_layer
    monkeypatch.setattr(stream.PrefetchingSource, "read_layer",
                        lambda self, layer: ahead.append((layer, set(self.pending))) or real_read(self, layer))
    prefetched = evaluate.compute_baseline(stream.group_scorer(make, config, activation_bytes=1), windows)
    assert isinstance(built[0].weights.source, stream.PrefetchingSource)
    assert (prefetched.logprobs == plain.logprobs).all() and (prefetched.top1 == plain.top1).all()
    assert set(source.reads.values()) == {len(windows)}  # once per group (one window per group here)
    layers = len(built[0].model.get_decoder().layers)
    assert [layer for layer, _ in ahead] == list(range(1, layers)) * len(windows)
    assert all(pending <= {layer - 1, layer} for layer, pending in ahead)  # the current layer and the next
    assert built[0].weights.source.pool._shutdown  # the thread is stopped when scoring ends
