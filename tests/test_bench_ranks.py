"""scripts/bench_ranks.py: launches, threads, a launch's timeout, the step difference of two quantized weights, the
tables; (slow) gptq and awq on one process and 2 gloo ranks, on a small random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import REPO, script_module, subprocess_env

SCRIPT = REPO / "scripts" / "bench_ranks.py"


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_ranks") as module:
        yield module


def test_launches_and_threads(bench):
    Launch = bench.Launch
    assert bench.parse_launch("4") == Launch(1, 4) and bench.parse_launch("2x1") == Launch(2, 1)
    assert bench.parse_launch("1@1") == Launch(1, 1, 1)
    launches = [bench.parse_launch(t) for t in ("1", "1@1", "2", "2x1", "2x2")]
    assert [launch.label for launch in launches] == [
        "1 process", "1 process, 1 thread", "2 ranks", "2 nodes x 1 rank", "2 nodes x 2 ranks"]
    assert [launch.key for launch in launches] == ["1", "1@1", "2", "2x1", "2x2"]
    # the machine's cores shared by every rank it runs; 4 ranks on 2 cores are oversubscribed
    assert [launch.threads_per_rank(2) for launch in launches] == [2, 1, 1, 1, 1]
    assert bench.Launch(1, 4).threads_per_rank(2) == 1
    args = bench.parse_args(["--launches", "4,2x1,2,1@1,2"])
    assert [launch.key for launch in args.launch_list] == ["1", "4", "2x1", "2", "1@1"]  # the reference first
    for bad in (["--methods", "gptq,int3"], ["--launches", "2y1"], ["--launches", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_every_launch_of_a_method_and_its_comparisons(bench, monkeypatch, tmp_path):
    """Every launch in --launches order; each artifact against the reference one-process artifact and the
    one-process artifact with its threads per rank; nothing compared with a refused launch."""
    ran = []

    def quantize_row(model, method, launch, args):
        ran.append((method, launch.key))
        refused = method == "awq" and launch.world > 1
        return {"method": method, "key": launch.key, "launch": launch.label, "world": launch.world, "ok": not refused,
                "threads_per_rank": launch.threads_per_rank(2),
                "rank_exit_codes": [2 if refused else 0] * launch.world, "artifact": f"{method}-{launch.key}",
                "metrics": {"kld_mean": 0.1}}

    monkeypatch.setattr(bench, "quantize_row", quantize_row)
    monkeypatch.setattr(bench, "compare_artifacts", lambda one, other: {"other": other.name})
    args = bench.parse_args(["--launches", "2,1@1,2x1", "--work", str(tmp_path)])
    gptq = bench.method_rows(tmp_path, "gptq", args)
    assert ran == [("gptq", "1"), ("gptq", "2"), ("gptq", "1@1"), ("gptq", "2x1")]
    # the reference, and the one-process run with the ranks' threads
    assert [[c["key"] for c in row["compared"]] for row in gptq] == [[], ["1", "1@1"], ["1"], ["1", "1@1"]]
    assert gptq[1]["compared"][1] == {"against": "1 process, 1 thread", "key": "1@1", "kld_mean": 0.1,
                                      "other": "gptq-2"}
    awq = bench.method_rows(tmp_path, "awq", args)
    assert [row.get("compared") for row in awq] == [[], None, [{"against": "1 process", "key": "1", "kld_mean": 0.1,
                                                                "other": "awq-1@1"}], None]


def test_a_refusal_is_exit_2_on_a_rank_before_work(bench):
    row = {"ok": False, "rank_exit_codes": [2, 2]}
    assert bench.refused_before_work(row)
    assert bench.refused_before_work({**row, "rank_exit_codes": [2, 143]})  # torchrun stopped rank 1 first
    assert not bench.refused_before_work({**row, "rank_exit_codes": [1, 143]})
    assert not bench.refused_before_work({**row, "rank_exit_codes": []})
    assert not bench.refused_before_work({"ok": True, "rank_exit_codes": [0, 0]})


def test_runs_of_the_same_settings_merge(bench):
    def run(rows, command, gate=()):
        return {"model": "WORK/m", "shape": "s", "settings": {"seq_len": 8}, "machine": "cpu", "command": command,
                "rows": [{"method": m, "key": k, "wall_s": w} for m, k, w in rows], "gate_rows": list(gate)}

    old = run([("gptq", "1", 1), ("gptq", "2", 2), ("awq", "2", 3)], "first", gate=[{"launch": "1 process"}])
    new = run([("awq", "1@1", 4), ("awq", "1", 5), ("gptq", "2", 6)], "second")
    merged = bench.merge_runs(old, new)
    assert [(r["method"], r["key"], r["wall_s"]) for r in merged["rows"]] == [
        ("gptq", "1", 1), ("gptq", "2", 6), ("awq", "1", 5), ("awq", "1@1", 4), ("awq", "2", 3)]
    assert merged["commands"] == ["first", "second"] and merged["gate_rows"] == [{"launch": "1 process"}]
    assert [bench.launch_order(k) for k in ("1", "1@1", "4", "2x1")] == sorted(
        bench.launch_order(k) for k in ("2x1", "4", "1@1", "1"))


def test_launch_commands(bench):
    assert bench.launch_commands(bench.Launch(threads=1), ["x.py"], "id") == [[sys.executable, "x.py"]]
    (two,) = bench.launch_commands(bench.Launch(1, 2), ["x.py"], "id")
    assert two[-4:] == ["--standalone", "--nproc-per-node", "2", "x.py"]
    first, second = bench.launch_commands(bench.Launch(2, 1), ["x.py"], "id")
    assert first == second and "--rdzv-backend" in first and first[first.index("--nnodes") + 1] == "2"
    assert first[first.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")


def test_step_difference_in_steps_of_the_first_scale(bench):
    import torch

    q1 = torch.tensor([[0, 1, 2, 3], [-1, -2, 7, -8]])
    scale = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    same = bench.step_difference(q1, scale, None, q1.clone(), scale.clone(), None)
    assert same == {"values": 8, "ints_changed": 0, "max_steps": 0.0, "scales": 4, "scales_changed": 0,
                    "max_scale_rel": 0.0}
    q2 = q1.clone()
    q2[1, 3] = -6  # two steps in the second group of row 1
    q2[0, 0] = 1
    moved = bench.step_difference(q1, scale, None, q2, scale, None)
    assert moved["ints_changed"] == 2 and moved["max_steps"] == 2.0
    # a scale 10% larger: every weight moves by 0.1 of its own value in steps; the largest is |-8| * 0.1
    rescaled = bench.step_difference(q1, scale, None, q1, scale * 1.1, None)
    assert rescaled["ints_changed"] == 0 and rescaled["scales_changed"] == 4
    assert rescaled["max_steps"] == pytest.approx(0.8) and rescaled["max_scale_rel"] == pytest.approx(0.1)
    # zero points and a g_idx: the weight is (q - z) * s of each column's group
    zero = torch.tensor([[1, 0], [0, 0]])
    g_idx = torch.tensor([1, 0, 1, 0])
    shifted = bench.step_difference(q1, scale, zero, q1, scale, zero + 1, g_idx, g_idx)
    assert shifted["max_steps"] == 1.0 and shifted["ints_changed"] == 0
    assert bench.column_groups(6, 2).tolist() == [0, 0, 0, 1, 1, 1]


def packed_artifact(path: Path, q, scale) -> Path:
    """A one-module pack-quantized compressed-tensors checkpoint (int4 symmetric, groups of 2)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"m.weight_packed": pack_to_int32(q.to(torch.int8), 4).contiguous(), "m.weight_scale": scale,
               "m.weight_shape": torch.tensor(list(q.shape)), "norm.weight": torch.ones(3)},
              str(path / "model.safetensors"))
    config = {"quantization_config": {"config_groups": {"group_0": {"weights": {"num_bits": 4}}}}}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_artifacts_compared_from_their_packed_ints(bench, tmp_path):
    import torch

    q = torch.randint(-8, 8, (4, 16), generator=torch.Generator().manual_seed(0))
    scale = torch.rand(4, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) + 0.1
    moved = q.clone()
    moved[2, 5] = 7 if q[2, 5] < 4 else -8
    one = packed_artifact(tmp_path / "one", q, scale)
    same = bench.compare_artifacts(one, packed_artifact(tmp_path / "same", q, scale))
    assert same["ints_changed"] == 0 and same["max_steps"] == 0 and same["other_max_abs"] == 0
    other = bench.compare_artifacts(one, packed_artifact(tmp_path / "other", moved, scale))
    assert other["ints_changed"] == 1 and other["max_steps"] == abs(int(moved[2, 5]) - int(q[2, 5]))
    assert other["worst_module"] == "m" and other["modules_changed"] == 1 and other["scales_changed"] == 0


def test_rank_zeros_report_read(bench):
    report = {"timings": {"baseline_s": 1.25, "total_s": 40.0},
              "targets": [{"timings": {"quantize_s": 30.0, "eval_s": 2.0}, "peak_rss_bytes": 1536 * 2**20,
                           "metrics": {"kld_mean": 0.01, "kld_p99": 0.02, "top1": 0.5, "positions": 2040}}]}
    columns = bench.report_columns(report)
    assert columns["phases"] == {"baseline_s": 1.25, "quantize_s": 30.0, "eval_s": 2.0, "total_s": 40.0}
    assert columns["gate_s"] == 3.25 and columns["report_peak_rss_mib"] == 1536
    assert columns["metrics"]["kld_mean"] == 0.01 and columns["metrics"]["ppl_increase"] is None


def test_the_refusal_is_quantkits_error_line(bench):
    log = ("W1127 warning\nerror: target 'awq': awq runs in one process only (why), but this is one of 2 torchrun "
           "ranks\nhint: launch ...\nerror: target 'awq': awq runs in one process only (why), but ...\n")
    assert bench.error_message(log).startswith("target 'awq': awq runs in one process only (why)")
    assert bench.error_message("Traceback\nRuntimeError: boom\n") == "RuntimeError: boom"


def row(bench, method, world, ok=True, **extra):
    label, _ = bench.METHODS[method]
    launch = bench.Launch(1, world)
    return {"method": method, "label": label, "launch": launch.label, "key": launch.key, "world": world,
            "threads_per_rank": launch.threads_per_rank(2), "wall_s": 10.0 * world, "ok": ok,
            "exit_codes": [0 if ok else 1], "rank_exit_codes": [0 if ok else 2] * world,
            "rank_peak_rss_mib": [900] * world, "pss_peak_mib": 800 * world,
            "load": {"start": 1.0, "max": 2.5, "end": 2.0}, **extra}


def test_the_tables(bench):
    done = {"phases": {"baseline_s": 1.5, "quantize_s": 30.25, "eval_s": 2.0}, "gate_s": 3.5,
            "metrics": {"kld_mean": 1.5e-5}}
    compared = [{"against": "1 process", "key": "1", "kld_mean": 1.4e-5, "values": 1000, "ints_changed": 5,
                 "max_steps": 1.0, "scales": 100, "scales_changed": 0, "max_scale_rel": 0.0, "other_max_abs": 0.0,
                 "by_layer": [{"layer": 0, "values": 500, "ints_changed": 1, "max_steps": 1.0}]}]
    rows = [row(bench, "gptq", 1, **done),
            row(bench, "gptq", 2, **done, compared=compared),
            row(bench, "awq", 2, ok=False, refusal="target 'awq': awq runs in one process only (why)")]
    load = {"start": 1.0, "max": 1.5, "end": 1.0}
    repeats = [{"baseline_s": b, "eval_s": e, "gate_s": b + e, "wall_s": 9.0, "kld_mean": 1.4e-5, "load": load}
               for b, e in ((2.0, 3.0), (2.5, 3.5), (1.0, 2.0))]
    gate = [{"launch": "1 process, 1 thread", "world": 1, "threads_per_rank": 1, "baseline_s": 4.0,
             "eval_s": 4.0, "gate_s": 8.0, "kld_mean": 1.4e-5, "load": load},
            bench.gate_summary(bench.Launch(1, 2), repeats, 2)]
    text = bench.render({"model": "WORK/m", "shape": "8,1,8,1,1,8", "settings": {"num_samples": 32, "seq_len": 256,
                                                                               "eval_windows": 8},
                         "machine": "CPU, 2 cores", "date": "2026-11-27", "rows": rows, "gate_rows": gate,
                         "gate_artifact": "gptq W4A16, act-order none"})
    lines = text.splitlines()
    one, two, awq = [line for line in lines if line.startswith(("| gptq", "| awq"))][:3]
    assert one.split(" | ")[1:8] == ["1 process", "2", "10.0", "30.2", "3.5 (1.5 + 2.0)", "900", "800"]
    assert "900 / 900" in two and "1.500e-05" in two and "1.0–2.5" in two
    assert "refused (rank exits 2, 2)" in awq
    assert "- awq W4A16: target 'awq': awq runs in one process only (why)" in lines
    compared = next(line for line in lines if "of 1000" in line)
    assert "| 2 ranks | 1 process | 5 of 1000 (0.50%) | 1 | 0.200%, 1 | 0 of 100 |" in compared
    assert "| identical |" in compared and "1.500e-05 / 1.400e-05" in compared
    two_ranks = next(line for line in lines if line.startswith("| 2 ranks")).split(" | ")
    assert two_ranks[2:7] == ["2.0", "3.0", "5.0", "5.0, 6.0, 3.0", "0.62x"]  # the medians of the repeats
    for table in (line for line in lines if line.startswith("|---")):  # every rule as wide as its header
        header = lines[lines.index(table) - 1]
        assert table.count("|") == header.count("|")


def test_the_differences_per_decoder_layer(bench):
    one = {"values": 10, "ints_changed": 1, "scales": 2, "scales_changed": 0, "max_steps": 1.0, "max_scale_rel": 0.0}
    parts = {"model.layers.0.mlp.up_proj": one, "model.layers.0.self_attn.q_proj": {**one, "ints_changed": 0},
             "model.layers.1.mlp.up_proj": {**one, "ints_changed": 4, "max_steps": 3.0}}
    merged = bench.merge_differences(parts)
    assert merged["by_layer"] == [{"layer": 0, "values": 20, "ints_changed": 1, "max_steps": 1.0},
                                  {"layer": 1, "values": 10, "ints_changed": 4, "max_steps": 3.0}]
    assert merged["ints_changed"] == 5 and merged["max_steps"] == 3.0
    assert merged["worst_module"] == "model.layers.1.mlp.up_proj" and merged["modules_changed"] == 2


def test_paths_under_work_are_scrubbed(bench):
    result = {"model": "/tmp/x/work/model", "rows": [{"command": "quantize /tmp/x/work/model -o /tmp/x/work/a"}]}
    assert bench.scrubbed(result, "/tmp/x/work") == {"model": "WORK/model",
                                                     "rows": [{"command": "quantize WORK/model -o WORK/a"}]}


@pytest.mark.parametrize("name", ["bench_ranks_reference.json", "bench_ranks_methods.json"])
def test_the_reference_json_renders_as_docs_shows_it(bench, name):
    """Each committed run renders, with no private path, and its rows are the ones docs/benchmarks.md shows."""
    runs = bench.load_runs(REPO / "docs" / name)
    assert runs and all("/tmp/" not in json.dumps(run) and "/work/" not in json.dumps(run) for run in runs)
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for run in runs:
        rendered = bench.render(run)
        assert "| method | launch |" in rendered
        rows = [line for line in rendered.splitlines() if line.startswith("| ") and "---" not in line]
        assert [row for row in rows if row not in page] == []


@pytest.mark.slow
def test_bench_ranks_on_a_small_model(bench, tmp_path):
    """gptq and awq in one process and on 2 gloo ranks (the ranks' artifact compared with the one-process one);
    the gate alone in one process and on 2 ranks."""
    work, out = tmp_path / "work", tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--shape", "256,2,512,4,2,4096", "--methods", "gptq,awq", "--launches", "1,2",
           "--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--gate-repeats", "1", "--work", str(work),
           "--json", str(out)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=subprocess_env(), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = bench.load_runs(out)
    rows = {(r["method"], r["world"]): r for r in run["rows"]}
    assert rows[("gptq", 1)]["ok"] and rows[("gptq", 2)]["ok"] and rows[("awq", 1)]["ok"]
    two = rows[("gptq", 2)]
    assert len(two["rank_peak_rss_mib"]) == 2 and two["threads_per_rank"] == 1
    (against,) = two["compared"]  # launches 1 and 2: the one-process run with the cores' threads only
    assert against["key"] == "1" and against["max_steps"] <= 2 and against["other_max_abs"] == 0
    (against,) = rows[("awq", 2)]["compared"]  # the smoothing written once: at most GPTQ-like rounding moves
    assert against["max_steps"] <= 2 and against["other_max_abs"] == 0
    assert [g["world"] for g in run["gate_rows"]] == [1, 1, 2]
    one_process = rows[("gptq", 1)]["metrics"]["kld_mean"]  # the same windows and artifact, 1 or 2 threads
    assert all(g["kld_mean"] == pytest.approx(one_process, rel=1e-4) for g in run["gate_rows"])
    assert str(work) not in out.read_text() and "| method | launch |" in done.stdout


def test_unpacked_int8_weights_are_compared_in_steps_and_the_kld_as_a_ratio(bench, tmp_path):
    """smoothquant's int8 weights (one scale per output channel) are compared like the packed ones."""
    import torch
    from safetensors.torch import save_file

    def artifact(name: str, weight) -> Path:
        (tmp_path / name).mkdir()
        save_file({"m.weight": weight, "m.weight_scale": torch.full((4, 1), 0.5, dtype=torch.bfloat16)},
                  str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({"quantization_config": {}}))
        return tmp_path / name

    q = torch.randint(-100, 100, (4, 8), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    moved = q.clone()
    moved[1, 2] += 3
    found = bench.compare_artifacts(artifact("one", q), artifact("other", moved))
    assert found["ints_changed"] == 1 and found["max_steps"] == 3.0 and found["values"] == 32
    assert bench.kld_ratio(1.05e-5, 1e-5) == "1.050x" and bench.kld_ratio(None, 1e-5) == "—"


def test_nvfp4_weights_are_compared_as_fp4_values_in_steps_of_their_scales(bench, tmp_path):
    """An nvfp4 weight (two E2M1 codes per byte, an fp8 scale per 16 columns, a global scale): one code moved from
    1.0 (code 2) to 2.0 (code 4) is one changed value, one step of the group's scale over the global scale."""
    import torch
    from safetensors.torch import save_file

    def artifact(name: str, packed) -> Path:
        (tmp_path / name).mkdir()
        save_file({"m.weight_packed": packed, "m.weight_global_scale": torch.tensor([0.25]),
                   "m.weight_scale": torch.full((2, 2), 0.5).to(torch.float8_e4m3fn)},
                  str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({"quantization_config": {}}))
        return tmp_path / name

    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)  # every value 1.0 (E2M1 code 2 in both nibbles)
    moved = packed.clone()
    moved[1, 3] = 0x24  # its high nibble (the second of the two values) now 2.0
    found = bench.compare_artifacts(artifact("one", packed), artifact("other", moved))
    assert found["values"] == 64 and found["ints_changed"] == 1 and found["scales_changed"] == 0
    assert found["max_steps"] == 1.0  # |2.0 - 1.0| x (0.5 / 0.25) over the step 0.5 / 0.25
    assert bench.compare_artifacts(artifact("same", packed), artifact("again", packed.clone()))["ints_changed"] == 0


def test_a_launch_past_its_timeout_is_stopped_and_recorded(bench, tmp_path):
    import os

    done = bench.run_launch([[sys.executable, "-c", "import time; time.sleep(120)"]], dict(os.environ),
                            tmp_path / "log", timeout=2)
    assert done["timed_out"] and done["exit_codes"] != [0] and done["wall_s"] < 60
