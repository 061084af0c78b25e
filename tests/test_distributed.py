"""quantkit.engines.llmcompressor.distributed: a torchrun launch read, its limits checked, the windows shared between
ranks; on 2 gloo ranks (slow), the artifact and the gate's metrics of one process, also as two nodes."""

import json
import os
import socket
import subprocess
import sys

import pytest

from quantkit.engines.llmcompressor.distributed import (
    ONE_PROCESS_FLAGS,
    RANK_PATCHES,
    Ranks,
    blind_ranks,
    check_launch,
    ranks_from,
    synchronized,
)
from quantkit.engines.patches import PATCHES, site_function
from quantkit.errors import InputError, UnsupportedError
from quantkit.methods.gptq import Options


@pytest.mark.parametrize("env, ranks", [
    ({}, Ranks()),
    ({"WORLD_SIZE": "1", "RANK": "0"}, Ranks()),
    ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, Ranks(3, 4, 1)),
    ({"WORLD_SIZE": "2", "RANK": "1"}, Ranks(1, 2, 1)),
])
def test_ranks_come_from_the_launcher_environment(env, ranks):
    assert ranks_from(env) == ranks


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "x"}, {"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "0"}])
def test_a_broken_launcher_environment_is_an_input_error(env):
    with pytest.raises(InputError) as info:
        ranks_from(env)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_the_shares_split_the_windows_as_llm_compressor_does(world):
    from llmcompressor.datasets.utils import _get_partition_start_end

    for count in range(world, 40):
        shares = [Ranks(rank, world).share(count) for rank in range(world)]
        assert [i for share in shares for i in range(count)[share]] == list(range(count))
        assert all(share.stop > share.start for share in shares)
        assert [(s.start, s.stop) for s in shares] == [_get_partition_start_end(count, r, world) for r in range(world)]


def launch(world=2, targets=(("gptq", "gptq", Options()),), num_samples=8, flags=(), eval_windows=4):
    from quantkit.methods import get_method, on_ranks

    specs = [(name, get_method(method), options) for name, method, options in targets]
    rows = []
    for name, spec, options in specs:
        runs, why = on_ranks(spec, options)  # whether the method runs on ranks, why these options do not
        rows.append((name, spec.name, runs, options, why))
    check_launch(Ranks(0, world), rows, num_samples, list(flags), eval_windows)


def method_options(method, **values):
    from quantkit.methods import get_method

    return get_method(method).options(**values)


def test_one_process_is_never_refused():
    launch(world=1, targets=[("fp8", "fp8", method_options("fp8", scheme="fp8-static"))], num_samples=0,
           flags=list(ONE_PROCESS_FLAGS))


def test_a_plain_gptq_target_runs_on_several_ranks():
    launch()
    launch(world=8, num_samples=8, eval_windows=8)


@pytest.mark.parametrize("method, values", [
    ("gptq", {"act_order": "group"}), ("nvfp4", {"scheme": "w4a4"}),
    ("nvfp4", {"scheme": "a16"}), ("fp8", {"scheme": "fp8-dynamic"}), ("fp8", {"scheme": "fp8-block"}),
    ("awq", {}), ("smoothquant", {}), ("fp8", {"scheme": "fp8-static"}), ("gptq", {"kv_cache": "fp8"}),
    ("autoround", {}), ("gptq", {"rotate": "spinquant"}), ("nvfp4", {"rotate": "hadamard"}),
    ("smoothquant", {"rotate": "spinquant"}), ("gptq", {"fallback": {}, "auto_precision": {}}),
    ("awq", {"auto_precision": {}}), ("fp8", {"fallback": {}}), ("mxfp4", {}),
])
def test_the_methods_llm_compressor_reduces_run_on_several_ranks(method, values):
    launch(targets=[(method, method, method_options(method, **values))])


def test_the_calibrated_activation_scales_reduce_exactly_over_ranks():
    """fp8-static's and the KV cache's observers keep a minimum and a maximum, which llm-compressor reduces over the
    ranks with MIN/MAX (sync_obs_act_stats): the one-process statistics, not an average of each rank's."""
    import torch.distributed as dist
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers.base import Observer

    from quantkit.engines.llmcompressor.llmc import kv_cache_scheme
    from quantkit.methods import fp8

    static = fp8.scheme_config(fp8.Options(scheme="fp8-static"))["group_0"]["input_activations"]
    for args in (static, kv_cache_scheme("fp8")):
        observer = Observer.load_from_registry(args["observer"], base_name="input", args=QuantizationArgs(**args))
        assert observer._act_sync_dict == {"min_vals": dist.ReduceOp.MIN, "max_vals": dist.ReduceOp.MAX}


@pytest.mark.parametrize("method, values, reason", [
    ("nf4", {}, "bitsandbytes quantizes the weights as transformers loads"), ("gguf", {}, "GGUF conversion"),
    ("mlx", {}, "MLX conversion"),
])
def test_a_method_without_llm_compressors_reduction_is_refused_with_the_reason(method, values, reason):
    with pytest.raises(UnsupportedError, match=f"{method} runs in one process only") as info:
        launch(targets=[(method, method, method_options(method, **values))])
    assert reason in info.value.message and info.value.exit_code == 2


@pytest.mark.parametrize("change, message", [
    (dict(targets=[("q", "gptq", Options()), ("f", "nf4", None)]), "target 'f': nf4 runs in one process only"),
    *[(dict(flags=[flag]), f"{flag} runs in one process only") for flag in ONE_PROCESS_FLAGS],
])
def test_what_needs_one_process_is_refused(change, message):
    with pytest.raises(UnsupportedError, match=message) as info:
        launch(**change)
    assert info.value.exit_code == 2 and "torchrun ranks" in info.value.message


def test_progress_saved_by_another_number_of_ranks_is_refused_naming_both(tmp_path):
    """--resume: each rank saved the hidden states of its share of the windows, so another number of ranks cannot
    continue them: exit 2 before any work, naming both numbers."""
    from quantkit.io.export import replace_json
    from quantkit.run import resume

    staging = tmp_path / "staging"
    resume.resume_dir(staging).mkdir(parents=True)
    replace_json(resume.resume_dir(staging) / resume.IDENTITY_FILE, resume.identity({}, {}, [], 2))
    resume.check_same(staging, resume.identity({}, {}, [], 2))
    for world in (1, 4):
        with pytest.raises(InputError, match=rf"made by 2 torchrun rank\(s\), and this launch has {world}") as info:
            resume.check_same(staging, resume.identity({}, {}, [], world))
        assert info.value.exit_code == 2 and "launch again with 2 rank(s)" in info.value.hint
    assert "world_size" not in resume.identity({}, {}, [], 1)  # one process's identity as before


def test_every_rank_needs_a_window():
    with pytest.raises(InputError, match="3 calibration windows cannot be shared by 4 ranks"):
        launch(world=4, num_samples=3)
    with pytest.raises(InputError, match="3 held-out windows cannot be shared by 4 ranks"):
        launch(world=4, num_samples=4, eval_windows=3)
    launch(world=4, num_samples=4, eval_windows=0)  # no gate: nothing to share


def test_the_ranks_that_cannot_see_the_staging_directory_are_named():
    assert blind_ranks([(True, "a"), (True, "b")]) == []
    assert blind_ranks([(True, "a"), (False, "b"), (False, "c")]) == ["rank 1 on b", "rank 2 on c"]


@pytest.mark.parametrize("name", RANK_PATCHES)
def test_the_hand_overs_are_patched_only_for_several_ranks(name):
    original = site_function(PATCHES[name].site)
    with synchronized(Ranks()):
        assert site_function(PATCHES[name].site) is original
    with synchronized(Ranks(1, 2)):
        assert site_function(PATCHES[name].site) is not original
    assert site_function(PATCHES[name].site) is original


def test_gathered_shares_of_the_positions_give_the_one_process_metrics():
    """Two ranks' shares (uneven: 5 and 15 positions) compared with their own baselines and gathered in
    rank order give every metric of one process, percentiles included (the gather is played here by
    recording rank 1's columns, then appending them to rank 0's)."""
    import numpy as np
    import torch

    from quantkit.eval import evaluate

    g = torch.Generator().manual_seed(0)
    base = [evaluate.ScoredChunk(torch.log_softmax(torch.randn(5, 11, generator=g), -1),
                                 torch.randint(0, 11, (5,), generator=g)) for _ in range(4)]
    cand = [evaluate.ScoredChunk(torch.log_softmax(c.logprobs + 0.5 * torch.randn(5, 11, generator=g), -1), c.targets)
            for c in base]
    whole = evaluate.compare_chunks(cand, evaluate.baseline_from_chunks(base, 20))
    recorded = []
    evaluate.compare_chunks(cand[1:], evaluate.baseline_from_chunks(base[1:], 15), lambda c: recorded.append(c) or c)
    later = iter(recorded)
    gathered = evaluate.compare_chunks(cand[:1], evaluate.baseline_from_chunks(base[:1], 5),
                                       lambda c: np.concatenate([c, next(later)]))
    assert gathered == whole and whole.positions == 20 and 0 < whole.top1 < 1


WINDOWS, SEQ_LEN = 4, 64
ARGS = ("--num-samples", "16", "--seq-len", str(SEQ_LEN), "--eval-windows", str(WINDOWS), "--no-gate")
# The least a launch of 2 ranks takes: one calibration window and one held-out window each.
FEW = ("--num-samples", "2", "--seq-len", "32", "--eval-windows", "2", "--no-gate")
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"} if os.path.exists("/sys/class/net/lo") else {}  # not the hostname's


def torchrun(launch: list[str], args: list[str]) -> subprocess.Popen:
    """`python -m torch.distributed.run LAUNCH -m quantkit quantize ARGS` on gloo, one thread per rank."""
    from tests.util import subprocess_env

    command = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "quantkit", "quantize", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(OMP_NUM_THREADS="1", **LOOPBACK))


def finished(process: subprocess.Popen) -> str:
    """The launch's stderr once it exits 0."""
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def positions(args) -> int:
    """Positions the gate scores: held-out windows x (tokens - 1)."""
    args = list(args)
    return int(args[args.index("--eval-windows") + 1]) * (int(args[args.index("--seq-len") + 1]) - 1)


def same_artifact(one, two, scored: int = WINDOWS * (SEQ_LEN - 1)) -> None:
    """Every tensor and every gate metric equal."""
    from safetensors.torch import load_file

    first, second = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert first.keys() == second.keys()
    assert [name for name in first if not first[name].equal(second[name])] == []
    metrics = [json.loads((d / "quantkit.json").read_text())["targets"][0]["metrics"] for d in (one, two)]
    assert metrics[0] == metrics[1]
    assert metrics[0]["positions"] == scored


def two_ranks_against_one_process(cli, model, out, method: tuple, args: tuple) -> None:
    args = [str(model), *method, *args]
    assert cli("quantize", *args, "-o", out / "one").exit_code == 0
    stderr = finished(torchrun(["--standalone", "--nproc-per-node", "2"], [*args, "-o", str(out / "two")]))
    windows = args[args.index("--eval-windows") + 1]
    assert f"baseline: scoring {windows} held-out windows on 2 ranks" in stderr
    assert f"rank 1 of 2: calibration and gate shares done; rank 0 writes {out / 'two'}" in stderr
    assert sorted(p.name for p in out.iterdir()) == ["one", "two"]  # no rank's work directory left
    same_artifact(out / "one", out / "two", positions(args))


# Methods whose ranks give the one process's artifact bit for bit (llm-compressor reduces their statistics
# exactly, or they calibrate nothing), with the calibration each launch takes: FEW, the least that exercises it.
BIT_FOR_BIT = [
    pytest.param(("--method", "nvfp4"), FEW, id="nvfp4"),
    pytest.param(("--method", "nvfp4"), ARGS, id="nvfp4-16-windows", marks=pytest.mark.slow),
    pytest.param(("--method", "fp8"), ARGS, id="fp8-dynamic", marks=pytest.mark.slow),
    pytest.param(("--method", "fp8", "--scheme", "fp8-static", "--kv-cache", "fp8"), ARGS, id="fp8-static-kv-cache",
                 marks=pytest.mark.slow),
    pytest.param(("--method", "nvfp4", "--rotate", "spinquant"), ARGS, id="nvfp4-spinquant", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("method, args", BIT_FOR_BIT)
def test_two_ranks_give_the_one_process_artifact_and_gate(cli, micro_model, tmp_path, method, args):
    """2 gloo ranks of the 2-layer micro model against one process. nvfp4 W4A4: each rank observes its share of
    the calibration windows, the activations' min and max are reduced (MIN/MAX: exact) and the global scales come
    out the same; fp8-dynamic calibrates nothing; fp8-static's activation scales and the KV cache's are the largest
    magnitude over the windows (static_minmax, reduced with MIN/MAX) and come out the same (the KV cache measured by
    rank 0 alone); SpinQuant's rotation is folded into the weights the ranks share by rank 0 alone, before any rank
    calibrates. The gate is scored by both ranks, each on its share of the held-out windows, every position's
    values gathered: the metrics, p99 and max included, are the one-process metrics exactly. Work: one in-process
    run, then torchrun's launcher and its 2 rank processes."""
    two_ranks_against_one_process(cli, micro_model, tmp_path, method, args)


SMOOTHQUANT_RTN = "targets:\n  - name: sq\n    method: smoothquant\n    options: {weight_algorithm: rtn}\n"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_two_ranks_smooth_once_and_give_the_one_process_artifact(cli, micro_model, tmp_path, method):
    """The smoothing's statistics reduced over both ranks' windows (AWQ: sums; SmoothQuant: MIN/MAX) and the weights
    the ranks share on a CPU written once, by rank 0: the artifact and the gate of one process, bit for bit (AWQ's
    sums happen to round the same here; SmoothQuant with round-to-nearest int8, whose weights depend on nothing
    summed)."""
    recipe = tmp_path / "sq.yaml"
    recipe.write_text(SMOOTHQUANT_RTN)
    args = [str(micro_model), *(["--method", "awq"] if method == "awq" else ["--recipe", str(recipe)]), *ARGS]
    assert cli("quantize", *args, "-o", tmp_path / "one").exit_code == 0
    finished(torchrun(["--standalone", "--nproc-per-node", "2"], [*args, "-o", str(tmp_path / "two")]))
    same_artifact(tmp_path / "one", tmp_path / "two", positions(args))


def kld(artifact) -> float:
    return json.loads((artifact / "quantkit.json").read_text())["targets"][0]["metrics"]["kld_mean"]


@pytest.mark.slow
def test_two_ranks_tune_autoround_to_the_one_process_quality(cli, micro_model, tmp_path):
    """Each rank tunes on its half of the windows with half the batch, one loss and averaged gradients: SignSGD's
    signs flip where the two halves' sums round differently, so the weights differ, but the KLD is within 1.05x of
    one process's (micro model, 200 iterations: 4.87e-6 against 4.80e-6)."""
    args = [str(micro_model), "--method", "autoround", *ARGS]
    assert cli("quantize", *args, "-o", tmp_path / "one").exit_code == 0
    finished(torchrun(["--standalone", "--nproc-per-node", "2"], [*args, "-o", str(tmp_path / "two")]))
    assert kld(tmp_path / "two") <= 1.05 * kld(tmp_path / "one")


def guide(artifact) -> dict:
    """What the guide chose and measured: the plan, each fallback step's raises and verdict, the probes' KLD."""
    target = json.loads((artifact / "quantkit.json").read_text())["targets"][0]
    fallback, table = target["details"]["fallback"], target["details"]["sensitivity"]["tensors"]
    return {"passed": fallback["passed"], "types": fallback["types"],
            "steps": [(s.get("raises"), s["passed"]) for s in fallback["steps"]],
            "probes": {r["tensor"]: r["kld"] for r in table if r["kld"] is not None}}


@pytest.mark.slow
def test_the_guide_on_two_ranks_makes_the_one_process_choices(cli, micro_model, tmp_path):
    """--fallback on 2 ranks: the sensitivity measured data-parallel (input statistics summed over the ranks, the
    probes' positions gathered: their KL divergences are one process's), rank 0 decides each step and the others
    follow it (re-quantize, score their share of the gate): the same raises in the same order and the same plan."""
    args = [str(micro_model), "--method", "gptq", "--fallback", "--max-kld", "3e-6", "--max-size", "+60%",
            *[a for a in ARGS if a != "--no-gate"]]
    assert cli("quantize", *args, "-o", tmp_path / "one").exit_code == 0
    finished(torchrun(["--standalone", "--nproc-per-node", "2"], [*args, "-o", str(tmp_path / "two")]))
    one, two = guide(tmp_path / "one"), guide(tmp_path / "two")
    assert one == two and one["steps"][0] == (None, False) and one["passed"]


RESUMED = ("--method", "gptq", "--num-samples", "16", "--seq-len", "64", "--eval-windows", "0")


@pytest.mark.slow
def test_a_two_rank_run_whose_rank_dies_resumes_on_two_ranks_byte_identical(micro_model, tmp_path):
    """Rank 1 killed right after the first layer is saved: torchrun stops rank 0 (it names the lost rank), nothing
    at OUT, the progress kept; one process cannot take it over (exit 2, both numbers named); two ranks resume
    after the saved layer and write the uninterrupted two-rank run's bytes."""
    from quantkit.io import export
    from tests.util import subprocess_env

    two = ["--standalone", "--nproc-per-node", "2"]
    plain, out = tmp_path / "plain", tmp_path / "out"
    finished(torchrun(two, [str(micro_model), *RESUMED, "-o", str(plain)]))
    command = [sys.executable, "-m", "torch.distributed.run", *two, "-m", "tests.cli.fault_run", "layer", "1", "KILL",
               "quantize", str(micro_model), *RESUMED, "-o", str(out), "--resume"]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            env=subprocess_env(OMP_NUM_THREADS="1", FAULT_RANK="1", **LOOPBACK))
    assert killed.returncode != 0 and not out.exists()
    assert "rank 0 of 2: another rank stopped" in killed.stderr and "progress kept in" in killed.stderr
    (staging,) = export.stagings(out.resolve())
    state = json.loads((staging / ".work" / "resume" / "gptq" / "layers" / "layers.json").read_text())
    assert state["world_size"] == 2 and len(state["layers"]) == 1 and len(state["activations"]) == 2
    one = subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(micro_model), *RESUMED, "-o", str(out),
                          "--resume"], capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert one.returncode == 2 and "was made by 2 torchrun rank(s), and this launch has 1" in one.stderr
    resumed = finished(torchrun(two, [str(micro_model), *RESUMED, "-o", str(out), "--resume"]))
    assert "resuming after 1 of 2 layers (verified by sha256)" in resumed
    assert (out / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_one_machine_give_the_one_process_artifact(cli, micro_model, tmp_path):
    """Two torchrun launches of one rank each, meeting at a c10d rendezvous on 127.0.0.1 (two "nodes"):
    the rank that node's launch makes 0 writes, the other checks it sees the staging directory, then
    calibrates and scores its share."""
    args = [str(micro_model), "--method", "nvfp4", *ARGS]
    assert cli("quantize", *args, "-o", tmp_path / "one").exit_code == 0
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "quantkit-test"]
    nodes = [torchrun(launch, [*args, "-o", str(tmp_path / "two")]) for _ in range(2)]
    stderr = [finished(node) for node in nodes]
    assert sum(f"rank 1 of 2: calibration and gate shares done" in text for text in stderr) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
    same_artifact(tmp_path / "one", tmp_path / "two")
