"""vLLM CPU reads a Gemma 3 fp8 artifact as quantkit's gate reads it, position by position, beyond the sliding
window as within it (scripts/setup_engines.sh; skipped without vLLM).

A tiny Gemma 3 text model (sliding-window and global layers alternating, window 32, the (1 + w) norms, tied
embeddings, query_pre_attn_scalar) with random weights, sharpened (quantkit.toy.sharpen: its final norm's
(1 + w) scaled) so its next-token distributions are peaked enough for a reading difference to show, is quantized
to fp8 (dynamic per-token activations). The engine's top-20 log-probs of held-out windows of 128 tokens are set
against quantkit's reading (quantkit.formats.gate.artifact_scorer) with serve-check's own KL bound
(quantkit.serve.stats): within serve-check's threshold, alike before and past the window, and no further from
quantkit's reading than that reading is from the base (the two are draws of the fp8 activation rounding: vLLM
multiplies in float32, compressed-tensors in bfloat16), the engine as close to the base as the reading. A
negative control serves a copy whose config.json says a window of 8: the positions beyond 8 then disagree, the
first 8 do not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from quantkit.serve import vllm_server
from tests.serve.test_serve_check_slow import require

pytestmark = pytest.mark.slow
WINDOW, SEQ_LEN, TOP_K = 32, 128, 20


@pytest.fixture(scope="module")
def gemma3_fp8(cli, tmp_path_factory) -> tuple[Path, Path]:
    """(the sharpened base, its fp8 artifact written by `quantkit quantize`)."""
    from quantkit.toy import sharpen
    from tests.families.common import build

    root = tmp_path_factory.mktemp("gemma3-serve")
    raw = build(root / "raw", "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=64, query_pre_attn_scalar=64,
                sliding_window=WINDOW, num_hidden_layers=4, tie_word_embeddings=True,
                layer_types=["sliding_attention", "full_attention"] * 2)
    base = sharpen(raw, root / "base", logit_scale=4.0, dtype="bfloat16")
    out = root / "fp8"
    result = cli("quantize", base, "--method", "fp8", "-o", out, "--num-samples", "8", "--seq-len", str(SEQ_LEN),
                 "--eval-windows", "2", "--no-gate")
    assert result.exit_code == 0, result.output
    return base, out


def held_out(base: Path) -> np.ndarray:
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    tokenizer = load_tokenizer(check_model_dir(base), False)
    return np.asarray(make_windows(tokenizer, Calibration(seq_len=SEQ_LEN, num_samples=0, eval_windows=2)).eval)


def reading_of(artifact: Path, base: Path, windows: np.ndarray):
    import torch

    from quantkit.eval import evaluate
    from quantkit.formats import gate

    return evaluate.compute_baseline(gate.artifact_scorer(artifact, base, "cpu", False), torch.from_numpy(windows))


def engine_topk(served: Path, base: Path, windows: np.ndarray, vocab: int):
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.serve import check
    from quantkit.serve.settings import Endpoint, ServeOptions

    engine = require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    options = ServeOptions(max_model_len=SEQ_LEN + 64, logprobs=TOP_K, concurrency=1)
    with check.serving(engine, served, options, None, lambda message: None) as (_log, url, _command):
        endpoint = Endpoint(url, load_tokenizer(check_model_dir(base), False), vocab, served)
        return vllm_server.prompt_topk(endpoint, windows.tolist(), TOP_K, lambda message: None)


def kl_by_position(reading, topk, windows: np.ndarray) -> np.ndarray:
    """serve-check's KL bound (engine top-k against the reading's full rows) per position, (windows, L - 1)."""
    from quantkit.serve import stats

    log_p, log_q = stats.full_on_cells(np.asarray(reading.logprobs[:], dtype=np.float64), topk)
    return stats.coarse_kl(log_p, log_q).reshape(windows.shape[0], -1)


def test_vllm_cpu_reads_gemma3_fp8_as_the_gate_beyond_the_window(gemma3_fp8, tmp_path):
    from quantkit.serve import stats
    from quantkit.serve.check import Tolerances

    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    base, artifact = gemma3_fp8
    windows = held_out(base)
    reading = reading_of(artifact, base, windows)
    vocab = int(reading.logprobs.shape[1])
    topk = engine_topk(artifact, base, windows, vocab)
    kl = kl_by_position(reading, topk, windows)
    within, beyond = kl[:, :WINDOW - 1].mean(), kl[:, WINDOW:].mean()
    threshold = Tolerances().max_reading_kld
    assert within <= threshold and beyond <= threshold, (within, beyond)
    assert beyond <= 3 * within + 1e-4, (within, beyond)  # the window read alike: no excess past it
    base_reading = reading_of(base, base, windows)
    own = stats.full_kl(base_reading.logprobs, reading.logprobs)  # the artifact's own KLD (the gate's)
    engine_from_base = stats.against_full(base_reading.logprobs, base_reading.top1, topk).kld_lower_bound
    assert kl.mean() <= own and engine_from_base <= 2 * own, (kl.mean(), own, engine_from_base)

    narrowed = tmp_path / "fp8-window-8"  # negative control: the engine told of a window of 8
    shutil.copytree(artifact, narrowed)
    config = json.loads((narrowed / "config.json").read_text())
    (narrowed / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    control = kl_by_position(reading, engine_topk(narrowed, base, windows, vocab), windows)
    assert control[:, :7].mean() <= threshold  # the first 8 positions see the same keys under either window
    assert control[:, WINDOW:].mean() > 10 * max(beyond, 1e-4), (beyond, control[:, WINDOW:].mean())
