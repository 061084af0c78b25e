"""--resume: an interrupted run continued from its saved progress, byte-identical to an uninterrupted one;
another run's progress refused naming what differs; no progress: a fresh start, said."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from quantkit.io import export
from quantkit.methods import get_method
from tests.test_export import dead_pid
from tests.util import leftovers, subprocess_env

GGUF = ("--method", "gguf", "--gguf-type", "Q4_K_M")  # imatrix auto: computed, then kept for the resumed run
FAST_CALIB = ("--num-samples", "4", "--seq-len", "64", "--eval-windows", "0")  # the bytes written, not the gate
TENSORS = 21  # the micro model's .gguf


def interrupted(micro_model, out, after: int, signal: str = "KILL", *extra: str) -> subprocess.CompletedProcess:
    """A --resume run of GGUF killed right after its `after`-th tensor is recorded (tests/cli/fault_run.py)."""
    cmd = [sys.executable, "-m", "tests.cli.fault_run", "tensor", str(after), signal, "quantize", str(micro_model),
           *GGUF, "-o", str(out), *FAST_CALIB, "--resume", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)


def saved_state(out) -> dict:
    (staging,) = export.stagings(out.resolve())
    (state,) = (staging / ".work" / "resume" / "gguf").glob("*.gguf.json")
    return json.loads(state.read_text())


def uninterrupted(cli, micro_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "out"
    result = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def plain(cli, micro_model, tmp_path_factory):
    return uninterrupted(cli, micro_model, tmp_path_factory)


def same_files(a, b, names) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("signal, after, code", [
    pytest.param("KILL", 8, -9, marks=pytest.mark.slow),
    ("TERM", 3, 143),
    pytest.param("KILL", 5, -9, marks=pytest.mark.slow),  # 25%
    pytest.param("KILL", 19, -9, marks=pytest.mark.slow),  # 90%
])
def test_an_interrupted_gguf_run_resumes_byte_identical(cli, micro_model, plain, tmp_path, signal, after, code):
    out = tmp_path / "out"
    first = interrupted(micro_model, out, after, signal)
    assert first.returncode == code, first.stderr
    assert not out.exists()
    assert [t["name"] for t in saved_state(out)["tensors"]][-1] and len(saved_state(out)["tensors"]) == after
    if signal == "TERM":
        assert "terminated (SIGTERM); nothing was written" in first.stderr
        assert "progress kept in" in first.stderr and "--resume" in first.stderr

    resumed = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resuming from the saved progress" in resumed.stderr
    assert "imatrix: read from the saved progress" in resumed.stderr
    assert f"resuming after {after} of {TENSORS} tensors (verified by sha256)" in resumed.stderr
    assert sum("converting: " in line for line in resumed.stderr.splitlines()) <= TENSORS - after
    same_files(plain, out, ["micro-Q4_K_M.gguf", "Modelfile"])
    assert leftovers(tmp_path, "out") == ["out"]
    assert ".work" not in {p.name for p in out.iterdir()}


def test_a_torn_tensor_is_written_again(cli, micro_model, plain, tmp_path):
    """Power loss: the last recorded tensor's bytes did not reach the disk; it fails its checksum and is rewritten."""
    out = tmp_path / "out"
    assert interrupted(micro_model, out, 6).returncode == -9
    (staging,) = export.stagings(out.resolve())
    gguf = staging / "micro-Q4_K_M.gguf"
    last = saved_state(out)["tensors"][-1]
    with open(gguf, "r+b") as fh:
        fh.truncate(last["offset"] + last["nbytes"] // 2)
    resumed = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming after 5 of {TENSORS} tensors" in resumed.stderr and "1 recorded tensor(s) did not verify" in resumed.stderr
    same_files(plain, out, ["micro-Q4_K_M.gguf"])


def kept_progress(cli, micro_model, out, monkeypatch, *extra: str):
    """A --resume run that failed after making its staging directory (its progress kept), owned by a dead pid."""
    from quantkit.errors import InternalError
    from quantkit.methods import gguf

    def fail(job):
        raise InternalError("stop here")

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "METHOD", __import__("dataclasses").replace(gguf.METHOD, quantize=fail))
        result = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB, "--resume", *extra)
    assert result.exit_code == 1, result.output
    assert "progress kept in" in result.stderr
    (staging,) = export.stagings(out.resolve())
    export.write_owner(staging, export.Owner(dead_pid(), socket.gethostname(), time.time()))
    return staging


@pytest.mark.parametrize("change, named", [
    (("--gguf-type", "Q6_K"), "targets.0.options.gguf_type: Q4_K_M -> Q6_K"),
    (("--seed", "7"), "recipe.calibration.seed"),
])
def test_progress_of_another_recipe_is_refused(cli, micro_model, tmp_path, monkeypatch, change, named):
    out = tmp_path / "out"
    staging = kept_progress(cli, micro_model, out, monkeypatch)
    result = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB, "--resume", *change)
    assert result.exit_code == 2, result.output
    assert "--resume: the saved progress in" in result.stderr and named in result.stderr
    assert staging.is_dir()  # refused: nothing removed


def test_progress_of_another_input_or_version_is_refused(cli, model_copy, tmp_path, monkeypatch):
    out = tmp_path / "out"
    staging = kept_progress(cli, model_copy, out, monkeypatch)
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "note": "edited"}))
    result = cli("quantize", model_copy, *GGUF, "-o", out, *FAST_CALIB, "--resume")
    assert result.exit_code == 2 and "inputs.model/config.json" in result.stderr, result.output
    (model_copy / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("quantkit.run.resume.__version__", "0.0.0-other")
    result = cli("quantize", model_copy, *GGUF, "-o", out, *FAST_CALIB, "--resume")
    assert result.exit_code == 2 and "quantkit_version" in result.stderr and "0.0.0-other" in result.stderr
    assert staging.is_dir()


def test_a_gate_change_is_not_a_different_run(cli, micro_model, plain, tmp_path, monkeypatch):
    out = tmp_path / "out"
    kept_progress(cli, micro_model, out, monkeypatch, "--max-kld", "0.5")
    result = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB, "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming from the saved progress" in result.stderr
    same_files(plain, out, ["micro-Q4_K_M.gguf"])


def test_resume_without_progress_starts_fresh_and_says_so(cli, micro_model, plain, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB, "--resume")
    assert result.exit_code == 0, result.output
    assert f"warning: --resume: no saved progress for {out}; starting fresh" in result.stderr
    same_files(plain, out, ["micro-Q4_K_M.gguf"])
    assert leftovers(tmp_path, "out") == ["out"]


def test_a_run_without_resume_removes_saved_progress(cli, micro_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    staging = kept_progress(cli, micro_model, out, monkeypatch)
    result = cli("quantize", micro_model, *GGUF, "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert f"removed {staging.name}" in result.stderr
    assert leftovers(tmp_path, "out") == ["out"]


@pytest.mark.parametrize("method, why", [
    ("nf4", "nf4 does not resume an interrupted run (--resume);"),
    (("fp8", "--scheme", "fp8-block"), "fp8 does not resume an interrupted run (--resume): it quantizes this model "
     "with llm-compressor's oneshot, which calibrates nothing layer by layer (fp8-block"),
    (("nvfp4", "--scheme", "a16"), "nvfp4 does not resume an interrupted run (--resume): this scheme "
     "calibrates nothing, so no layer-by-layer progress is saved"),
    (("gptq", "--fallback"), "gptq does not resume an interrupted run (--resume): --auto-precision and "
     "--fallback quantize again for each step of their search"),
])
def test_a_method_that_does_not_resume_is_refused_before_work(cli, micro_model, tmp_path, method, why):
    method = (method,) if isinstance(method, str) else method
    result = cli("quantize", micro_model, "--method", *method, "-o", tmp_path / "out", *FAST_CALIB, "--num-samples",
                 "16", "--resume")
    assert result.exit_code == 2, result.output
    assert f"target '{method[0]}': {why}" in result.stderr
    assert "gguf (from the last written tensor)" in result.stderr
    assert "gptq (from the last finished decoder layer)" in result.stderr
    assert leftovers(tmp_path, "out") == []


@pytest.fixture(scope="module")
def toy_moe(tmp_path_factory):
    """A synthetic Qwen3-MoE checkpoint (quantkit.toy_moe), which fp8-block quantizes without loading it."""
    from quantkit.toy_moe import build_moe

    return build_moe("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


# the model-free path's resume by shard fast without a run: tests/methods/test_model_free.py
# (test_an_interrupted_write_resumes_after_its_last_finished_shard)
@pytest.mark.parametrize("model, scheme", [pytest.param("micro_model", "fp8-dynamic", marks=pytest.mark.slow),
                                           pytest.param("toy_moe", "fp8-block", marks=pytest.mark.slow)])
def test_fp8_model_free_resumes_after_its_last_shard(cli, request, tmp_path_factory, tmp_path, model, scheme):
    """fp8's model-free paths (fp8-dynamic on a dense model, fp8-block on an MoE one by its checkpoint names):
    each artifact here is one shard; killed after it, the resumed run writes no weight again."""
    model = request.getfixturevalue(model)
    fp8 = ("--method", "fp8", "--scheme", scheme, *FAST_CALIB)
    plain = tmp_path_factory.mktemp("plain-fp8") / "out"
    assert cli("quantize", model, *fp8, "-o", plain).exit_code == 0
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tests.cli.fault_run", "shard", "1", "KILL", "quantize", str(model), *fp8,
           "-o", str(out), "--resume"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert first.returncode == -9, first.stderr
    resumed = cli("quantize", model, *fp8, "-o", out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "model-free: resuming after 1 of 1 shards (verified by sha256)" in resumed.stderr
    same_files(plain, out, ["model.safetensors", "config.json", "recipe.yaml"])
    assert leftovers(tmp_path, "out") == ["out"]


LAYERS = 2  # the micro model's decoder layers (llm-compressor's sequential pipeline: a subgraph each, and the head's)
# One window of the 1024 tokens the calibrated methods need at least: each window is a forward per layer and
# per pass, so one long window costs a third of 16 short ones' time on this CPU.
SEQUENTIAL = ("--num-samples", "1", "--seq-len", "1024", "--eval-windows", "0")
# Each sequential method that resumes, with the least work that still exercises it: autoround tunes 2
# iterations of a batch of the one window, awq searches 3 grid points (the fewest with duo scaling).
RESUMABLE = {
    "gptq": {},
    "awq": {"n_grid": 3},
    "smoothquant": {},
    "autoround": {"iters": 2, "batch_size": 1},
    "nvfp4": {},
    "fp8-static": {"method": "fp8", "scheme": "fp8-static"},
}


def sequential_recipe(root, name: str) -> str:
    """A recipe of one target named `name` (its method, unless the options name another) with its options."""
    import yaml

    options = dict(RESUMABLE[name])
    method = options.pop("method", name)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"targets": [{"name": name, "method": method, "options": options}]}))
    return str(path)


@pytest.fixture(scope="module")
def plain_sequential(cli, micro_model, tmp_path_factory):
    """The uninterrupted run of each method a test resumes, made once: plain(name) -> (artifact, its recipe)."""
    made = {}

    def plain(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp("plain-seq")
            recipe = sequential_recipe(root, name)
            result = cli("quantize", micro_model, "--recipe", recipe, "-o", root / "out", *SEQUENTIAL)
            assert result.exit_code == 0, result.output
            made[name] = root / "out", recipe
        return made[name]

    return plain


def killed_after_layer(micro_model, out, recipe: str, after: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.cli.fault_run", "layer", str(after), "KILL", "quantize", str(micro_model),
           "--recipe", recipe, "-o", str(out), *SEQUENTIAL, "--resume"]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)


def assert_saved_progress_within_the_estimate(micro_model, out, name: str) -> None:
    """The files a killed run left for --resume against the preflight's estimate of them (MethodSpec.resume.bytes):
    no more than estimated, and the estimate's per-window term (two copies) covers the saved inputs of the next
    layer, which hold at least the calibration tokens' residual stream in the model's dtype."""
    from types import SimpleNamespace

    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.recipe import Target, target_options

    (staging,) = export.stagings(out.resolve())
    saved = [f for f in (staging / ".work" / "resume").rglob("*") if f.is_file()]
    activations = [f.stat().st_size for f in saved if f.name.startswith("activations-")]
    info, samples, seq_len = check_model_dir(micro_model), 1, 1024  # SEQUENTIAL
    options = dict(RESUMABLE[name])
    target = Target(name=name, method=options.pop("method", name), options=options)
    spec, options = get_method(target.method), target_options(target)
    estimate = spec.resume.bytes(info, options, SimpleNamespace(num_samples=samples, seq_len=seq_len))
    weights = spec.resume.bytes(info, options, SimpleNamespace(num_samples=0, seq_len=seq_len))
    assert len(activations) == 1 and sum(f.stat().st_size for f in saved) <= estimate
    assert samples * seq_len * info.config["hidden_size"] * 2 <= activations[0] <= (estimate - weights) / 2  # bf16


# killed and resumed runs fast: the GGUF ones above; the layer-by-layer resume fast without a run:
# tests/engines/test_layer_resume.py
@pytest.mark.parametrize("name, after", [
    pytest.param("gptq", 1, marks=pytest.mark.slow),
    pytest.param("gptq", 2, marks=pytest.mark.slow),
    pytest.param("awq", 1, marks=pytest.mark.slow),  # a smoothing method: its scales resumed with the layers
    pytest.param("smoothquant", 1, marks=pytest.mark.slow),
    pytest.param("autoround", 1, marks=pytest.mark.slow),
    pytest.param("nvfp4", 1, marks=pytest.mark.slow),
    # after the last layer: the resumed run calibrates nothing
    pytest.param("fp8-static", 2, marks=pytest.mark.slow),
])
def test_a_sequential_method_resumes_after_its_last_finished_layer(cli, micro_model, plain_sequential, tmp_path,
                                                                   name, after):
    """Killed (SIGKILL) right after layer `after` is saved, the resumed run calibrates only the layers after it
    and writes the uninterrupted run's bytes. Work: the uninterrupted run and the resumed one in this process,
    the killed one in a child process, each on one window of 1024 tokens through 2 decoder layers."""
    plain, recipe = plain_sequential(name)
    out = tmp_path / "out"
    first = killed_after_layer(micro_model, out, recipe, after)
    assert first.returncode == -9, first.stderr
    assert f"layer {after}/{LAYERS} saved for --resume" in first.stderr
    assert_saved_progress_within_the_estimate(micro_model, out, name)
    resumed = cli("quantize", micro_model, "--recipe", recipe, "-o", out, *SEQUENTIAL, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming after {after} of {LAYERS} layers (verified by sha256)" in resumed.stderr
    assert f"layer {after}/{LAYERS} saved" not in resumed.stderr  # not calibrated again
    same_files(plain, out, ["model.safetensors", "config.json", "recipe.yaml"])
    assert leftovers(tmp_path, "out") == ["out"]


@pytest.mark.slow  # tests/engines/test_layer_resume.py checks the same without a run
def test_saved_layers_that_do_not_verify_are_set_aside(cli, micro_model, plain_sequential, tmp_path):
    """A saved layer torn by a power loss fails its checksum: the run says so and starts from the first layer."""
    plain, recipe = plain_sequential("gptq")
    out = tmp_path / "out"
    assert killed_after_layer(micro_model, out, recipe, 1).returncode == -9
    (staging,) = export.stagings(out.resolve())
    (saved,) = (staging / ".work" / "resume" / "gptq" / "layers").glob("layer-*.safetensors")
    saved.write_bytes(saved.read_bytes()[:-7])
    resumed = cli("quantize", micro_model, "--recipe", recipe, "-o", out, *SEQUENTIAL, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert ("the saved layers are not used (layer-00000.safetensors does not verify (sha256)); starting from the "
            "first") in resumed.stderr
    same_files(plain, out, ["model.safetensors"])
