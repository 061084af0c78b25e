#!/usr/bin/env python
"""Benchmark: `quantkit quantize` on torchrun ranks (gloo, CPU) against one process, on this machine.

    python scripts/bench_ranks.py [--shape H,LAYERS,FFN,HEADS,KV,VOCAB | --model DIR]
                                  [--methods gptq,gptq-actorder,awq,autoround] [--launches 1,1@1,2,4,2x1]
                                  [--num-samples 32] [--seq-len 256] [--eval-windows 8] [--timeout 3600]
                                  [--no-gate-rows | --gate-repeats 3] [--gate-artifact DIR]
                                  [--work DIR] [--json out.json [--append]]
    python scripts/bench_ranks.py --render out.json     # the markdown tables of a JSON written before

The model: a random-init Llama of --shape (default 768,12,2048,12,4,32000: the 125M shape of
scripts/bench_gpu.py, bf16, quantkit's toy tokenizer), built once into WORK, or --model DIR as it is.
Random weights make every KL divergence tiny: the table is about time, memory and whether the ranks'
artifact is the one-process artifact.

Each method runs once per launch, every launch with the same calibration and held-out windows and the
same flags (`--no-gate`: the gate is measured in full, not enforced). The methods (METHODS): gptq with
act-order none or static, awq, autoround (light preset), nvfp4, fp8-dynamic, fp8-static, smoothquant, gptq and
nvfp4 with spinquant, gptq with --auto-precision, and gptq with a --fallback whose gate never passes (every step of
its search runs until +10% is spent). Each launch is stopped after --timeout seconds and recorded as timed out
(a hang fails the row, never the benchmark).

  1         `python -m quantkit quantize MODEL ...` in one process (always run: the reference)
  N         `torchrun --standalone --nproc-per-node N -m quantkit quantize ...` (gloo)
  2x1       two torchrun launches of one rank each, `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint
            127.0.0.1:PORT`: two "nodes" on one machine
  1@1       any of them with @T: T threads per rank (1@1: one process with one core's threads, the same
            threads per rank as 2 ranks on 2 cores)

OMP_NUM_THREADS is the machine's cores divided by the ranks it runs (at least 1), so a launch uses as
many threads as there are cores; 4 ranks on a 2-core machine are oversubscribed (4 threads on 2 cores).
GLOO_SOCKET_IFNAME=lo keeps gloo on the loopback. Each rank runs quantkit's CLI in-process through this
script (`--rank-child`, which is `python -m quantkit` plus a record of the process's own peak RSS, from
getrusage, and its exit code at exit); a sampler adds up the proportional set size (PSS: shared pages
counted once) of every process of the launch every 0.5 s, and the 1-minute load average.

Recorded per run: wall seconds of the whole launch, rank 0's phases from its quantkit.json (quantize; the
gate: baseline + artifact scoring, data-parallel on ranks), each rank's peak RSS, the launch's peak PSS,
the gate's metrics (KLD mean and p99, top-1), and, for every artifact, the comparison with the
one-process artifacts of the same method (the one with the cores' threads, and the one with as many
threads per rank as this launch, which tells what another thread count alone changes): the share of int
values that differ, the largest weight difference in quantization steps (|w - w_one| / the one-process
scale of that group, after dequantizing both), the share of scales that differ and their largest relative
difference, in all and in the first decoder layer (which calibrates on the same inputs in every launch); an
unpacked int8 or fp8 weight is compared the same way (its values and per-channel or block scales); and the KLD
of the artifact over the one-process artifact's.
A method refused on ranks is recorded with each rank's exit code and message (quantkit refuses before
any work).

Then the gate alone, on the first method's one-process artifact and the same held-out windows (the steps
of `quantkit eval`, run by `--gate-child`): one process with all cores' threads, one process with one
core's threads (what rank 0 would take scoring every window itself on a launch of one rank per core: quantkit
has no switch for rank-0-only scoring), and 2 and 4 ranks each scoring its share, gathered as
quantize's gate gathers them; each --gate-repeats times, taking turns, the medians shown (--gate-artifact:
another artifact, with `--methods ''` the gate rows alone).

Output: the markdown tables on stdout; --json writes the records (paths under WORK written as WORK);
--append keeps the runs already in that file and merges this run's rows into the last one when it has the
same model, settings and machine (to rerun or add a method or a launch; artifacts are compared within one
run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # children import this checkout's quantkit
sys.path.insert(0, str(ROOT / "scripts"))

SHAPE_125M = "768,12,2048,12,4,32000"
METHODS = {  # name -> (label, quantkit flags)
    "gptq": ("gptq W4A16, act-order none", ["--method", "gptq", "--act-order", "none"]),
    "gptq-actorder": ("gptq W4A16, act-order static (default)", ["--method", "gptq", "--act-order", "static"]),
    "awq": ("awq W4A16", ["--method", "awq"]),
    "autoround": ("autoround W4A16, light preset", ["--method", "autoround", "--preset", "light"]),
    "nvfp4": ("nvfp4 W4A4", ["--method", "nvfp4"]),
    "fp8": ("fp8-dynamic", ["--method", "fp8"]),
    "fp8-static": ("fp8-static", ["--method", "fp8", "--scheme", "fp8-static"]),
    "smoothquant": ("smoothquant W8A8 (GPTQ int8)", ["--method", "smoothquant"]),
    "gptq-spinquant": ("gptq W4A16, spinquant", ["--method", "gptq", "--act-order", "none", "--rotate", "spinquant"]),
    "nvfp4-spinquant": ("nvfp4 W4A4, spinquant", ["--method", "nvfp4", "--rotate", "spinquant"]),
    "gptq-auto": ("gptq, --auto-precision", ["--method", "gptq", "--act-order", "none", "--auto-precision"]),
    # the gate can never pass: every step of the fallback's search runs (its sensitivity, each re-quantization and
    # reading), until --max-size is spent; --no-gate keeps the run's exit 0
    "gptq-fallback": ("gptq, --fallback to +10%", ["--method", "gptq", "--act-order", "none", "--fallback",
                                                   "--max-kld", "1e-12", "--max-size", "+10%"]),
}
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"} if os.path.exists("/sys/class/net/lo") else {}
SAMPLE_S = 0.5


# ---------------------------------------------------------------- launches


@dataclass(frozen=True)
class Launch:
    """`nodes` torchrun launches of `per_node` ranks each on this machine (1 x 1: one process, no torchrun),
    each rank with `threads` threads (None: this machine's cores shared by all its ranks)."""

    nodes: int = 1
    per_node: int = 1
    threads: int | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def key(self) -> str:
        """As --launches spells it: '1', '1@1', '4', '2x1'."""
        ranks = str(self.per_node) if self.nodes == 1 else f"{self.nodes}x{self.per_node}"
        return ranks + (f"@{self.threads}" if self.threads else "")

    @property
    def label(self) -> str:
        if self.nodes == 1:
            text = "1 process" if self.per_node == 1 else f"{self.per_node} ranks"
        else:
            text = f"{self.nodes} nodes x {self.per_node} rank{'s' if self.per_node > 1 else ''}"
        return text + (f", {self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads else "")

    def threads_per_rank(self, cores: int) -> int:
        return self.threads or threads_per_rank(cores, self.world)


def parse_launch(text: str) -> Launch:
    """'4' -> one node of 4 ranks; '2x1' -> 2 nodes of 1 rank; '1@1' -> one process with 1 thread."""
    ranks, _, threads = text.partition("@")
    nodes, _, per_node = ranks.partition("x") if "x" in ranks else ("1", "", ranks)
    try:
        launch = Launch(int(nodes), int(per_node), int(threads) if threads else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"launch {text!r}: N, MxN or either with @THREADS") from None
    if launch.nodes < 1 or launch.per_node < 1 or (launch.threads is not None and launch.threads < 1):
        raise argparse.ArgumentTypeError(f"launch {text!r}: nodes, ranks and threads must be at least 1")
    return launch


def threads_per_rank(cores: int, ranks: int) -> int:
    """OMP_NUM_THREADS for each rank: this machine's cores shared by the ranks it runs (every rank of every
    "node" here), at least one each."""
    return max(1, cores // ranks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_commands(launch: Launch, program: list[str], run_id: str) -> list[list[str]]:
    """The command of each node's launch: `python PROGRAM` for one process, torchrun otherwise."""
    nodes, per_node = launch.nodes, launch.per_node
    if launch.world == 1:
        return [[sys.executable, *program]]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        return [[*torchrun, "--standalone", "--nproc-per-node", str(per_node), *program]]
    rendezvous = ["--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id]
    return [[*torchrun, *rendezvous, *program] for _ in range(nodes)]


# ---------------------------------------------------------------- sampling the launch's processes


def process_tree(roots: list[int]) -> list[int]:
    """The roots and every descendant alive now (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class TreeSampler:
    """While inside: the peak of the summed PSS of the launch's processes, and the 1-minute load average
    (first, largest, last), every SAMPLE_S seconds."""

    def __init__(self, roots: list[int]):
        self.roots, self.peak_kib, self.loads = roots, 0, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak_kib = max(self.peak_kib, sum(pss_kib(pid) for pid in process_tree(self.roots)))
            self.loads.append(os.getloadavg()[0])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.loads.append(os.getloadavg()[0])

    def columns(self) -> dict:
        return {"pss_peak_mib": round(self.peak_kib / 1024),
                "load": {"start": self.loads[0], "max": max(self.loads), "end": self.loads[-1]}}


def run_launch(commands: list[list[str]], env: dict, log: Path, timeout: float | None = None) -> dict:
    """Start every node's launch at once and wait for all: wall seconds, exit codes, PSS and load. Past
    `timeout` seconds (a hang), or stopped (Ctrl-C, SIGTERM), the launches are terminated (torchrun stops its
    ranks); a timed-out launch is recorded with "timed_out"."""
    started = time.time()
    deadline = None if timeout is None else started + timeout
    with open(log, "w") as fh:
        procs = [subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env) for cmd in commands]
        try:
            with TreeSampler([p.pid for p in procs]) as sampler:
                codes = [wait_until(p, deadline) for p in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
    timed_out = None in codes
    codes = [proc.returncode for proc in procs]
    return {"wall_s": round(time.time() - started, 1), "exit_codes": codes, **sampler.columns(),
            **({"timed_out": True} if timed_out else {})}


def wait_until(proc: subprocess.Popen, deadline: float | None) -> int | None:
    """The process's exit code, or None once `deadline` (time.time()) has passed."""
    try:
        return proc.wait(None if deadline is None else max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        return None


# ---------------------------------------------------------------- children


def rank_child(argv: list[str]) -> None:
    """`python -m quantkit ARGS` in this process, then this process's peak RSS and exit code into
    DIR/rank{RANK}.json (argv: DIR, ARGS...)."""
    import resource
    import runpy

    where, args = Path(argv[0]), argv[1:]
    code: object = 0
    sys.argv = ["quantkit", *args]
    try:
        runpy.run_module("quantkit", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        raise
    except BaseException:
        code = 1
        raise
    finally:
        code = code if isinstance(code, int) else (0 if code is None else 1)
        rank = os.environ.get("RANK", "0")
        record = {"rank": int(rank), "world": int(os.environ.get("WORLD_SIZE", "1")), "exit_code": code,
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  "threads": int(os.environ.get("OMP_NUM_THREADS", "0"))}
        (where / f"rank{rank}.json").write_text(json.dumps(record))


def gate_child(argv: list[str]) -> None:
    """The gate alone on ranks or in one process (argv: MODEL ARTIFACT OUT_JSON SEQ_LEN EVAL_WINDOWS): the
    held-out windows `quantkit eval` takes, the base scored on this rank's share, then the artifact, the
    positions gathered on every rank; rank 0 writes the seconds of each and the metrics to OUT_JSON."""
    import torch.distributed as dist

    from quantkit.cli.eval import eval_windows
    from quantkit.engines.llmcompressor.distributed import gather_for, process_group, ranks_from
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.eval import evaluate, scorers
    from quantkit.formats import detect, gate
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.preflight import eval_placement

    model, artifact, out, seq_len, count = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3]), int(argv[4])
    ranks = ranks_from(os.environ)
    info = check_model_dir(model)
    windows = eval_windows(load_tokenizer(info), "default", count, seq_len, 0)
    placement = eval_placement(info, detect(artifact), "cpu", seq_len, len(windows))
    share = windows[ranks.share(len(windows))]
    gather = gather_for(ranks)
    with process_group(ranks, "cpu"), tempfile.TemporaryDirectory(prefix="bench-ranks-gate-") as tmp:
        if ranks.distributed:
            dist.barrier()  # every rank past its imports
        started = time.time()
        baseline = evaluate.compute_baseline(scorers.base_scorer(info, placement=placement, workdir=Path(tmp)),
                                             share, workdir=Path(tmp), spill=placement.spill)
        if gather:
            gather(baseline.nll)
        middle = time.time()
        metrics = gate.evaluate_artifact(artifact, info.path, share, baseline, "cpu", workdir=Path(tmp),
                                            placement=placement, gather=gather)
        done = time.time()
    if ranks.is_main:
        out.write_text(json.dumps({"baseline_s": round(middle - started, 2), "eval_s": round(done - middle, 2),
                                   "gate_s": round(done - started, 2), "resident": placement.resident,
                                   "kld_mean": metrics.kld_mean, "positions": metrics.positions}))


# ---------------------------------------------------------------- the model


def shape_of(text: str) -> tuple:
    hidden, layers, ffn, heads, kv, vocab = (int(v) for v in text.split(","))
    return hidden, layers, ffn, heads, kv, vocab, False


def the_model(args) -> Path:
    if args.model:
        return args.model.resolve()
    from bench_gpu import build_model

    return build_model(args.work / f"model-{args.shape.replace(',', '_')}", shape_of(args.shape), "cpu")


# ---------------------------------------------------------------- one row


def quantize_row(model: Path, method: str, launch: Launch, args) -> dict:
    label, flags = METHODS[method]
    name = f"{method}-{launch.key}"
    out, ranks_dir = args.work / "artifacts" / name, args.work / "ranks" / name
    ranks_dir.mkdir(parents=True, exist_ok=True)
    for old in ranks_dir.glob("rank*.json"):
        old.unlink()
    quantize = ["quantize", str(model), *flags, *calib_flags(args), "--no-gate", "--device", "cpu", "-o", str(out),
                "--overwrite"]
    threads = launch.threads_per_rank(args.cores)
    commands = launch_commands(launch, [__file__, "--rank-child", str(ranks_dir), *quantize],
                               f"bench-ranks-{name}-{os.getpid()}")
    log(f"{label}, {launch.label} ({threads} thread(s) per rank) ...")
    row = {"method": method, "label": label, "launch": launch.label, "key": launch.key, "nodes": launch.nodes,
           "ranks_per_node": launch.per_node, "world": launch.world, "threads_per_rank": threads,
           "command": shown_command(launch, quantize, threads),
           **run_launch(commands, child_env(threads), args.work / "logs" / f"{name}.log", args.timeout),
           "artifact": str(out)}
    ranks = sorted((json.loads(p.read_text()) for p in ranks_dir.glob("rank*.json")), key=lambda r: r["rank"])
    row["rank_peak_rss_mib"] = [r["peak_rss_mib"] for r in ranks]
    row["rank_exit_codes"] = [r["exit_code"] for r in ranks]
    row["ok"] = all(code == 0 for code in row["exit_codes"]) and (out / "quantkit.json").is_file()
    if row["ok"]:
        row.update(report_columns(json.loads((out / "quantkit.json").read_text())))
    else:
        row["refusal"] = (f"timed out after {args.timeout:.0f} s" if row.get("timed_out")
                          else error_message((args.work / "logs" / f"{name}.log").read_text()))
        row.pop("artifact")
    log(f"  wall {row['wall_s']} s, exit {row['exit_codes']}, peak RSS per rank {row['rank_peak_rss_mib']} MiB, "
        f"load {load_text(row['load'])}" + (f", refused: {row['refusal']}" if not row["ok"] else ""))
    return row


def refused_before_work(row: dict) -> bool:
    """quantkit refused the launch (exit 2, bad input: its refusals come before any work) on a rank, and
    every other rank did the same or was stopped by torchrun first (143: SIGTERM)."""
    codes = set(row.get("rank_exit_codes") or [])
    return not row["ok"] and 2 in codes and codes <= {2, 143}


def child_env(threads: int) -> dict:
    """This checkout's quantkit first, `threads` OpenMP threads, gloo on the loopback."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), **LOOPBACK}


def method_rows(model: Path, method: str, args) -> list[dict]:
    """Every launch of one method, in --launches order, each artifact compared with the one-process ones."""
    rows = [quantize_row(model, method, launch, args) for launch in args.launch_list]
    add_comparisons(rows)
    return rows


def add_comparisons(rows: list[dict]) -> None:
    """Each artifact against the one-process artifacts of its method: the reference (key '1', the cores'
    threads) and the one-process run with the same threads per rank (1@1 for ranks of one thread), where
    they ran: the second tells the ranks' differences from what another thread count alone changes."""
    ones = [row for row in rows if row["world"] == 1 and row["ok"]]
    for row in rows:
        if not row["ok"]:
            continue
        against = [one for one in ones if one is not row
                   and (one["key"] == "1" or one["threads_per_rank"] == row["threads_per_rank"])]
        row["compared"] = [{"against": one["launch"], "key": one["key"], "kld_mean": one["metrics"].get("kld_mean"),
                            **compare_artifacts(Path(one["artifact"]), Path(row["artifact"]))} for one in against]


def calib_flags(args) -> list[str]:
    return ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
            "--eval-windows", str(args.eval_windows)]


def shown_command(launch: Launch, quantize: list[str], threads: int) -> str:
    """What a user types for this launch (the model and output named as they were)."""
    if launch.world == 1:
        launcher = "python -m quantkit"
    elif launch.nodes == 1:
        launcher = f"torchrun --standalone --nproc-per-node {launch.per_node} -m quantkit"
    else:
        launcher = (f"torchrun --nnodes {launch.nodes} --nproc-per-node {launch.per_node} --rdzv-backend c10d "
                    "--rdzv-endpoint 127.0.0.1:PORT -m quantkit")
    return f"OMP_NUM_THREADS={threads} {launcher} {shlex.join(quantize)}"


def report_columns(report: dict) -> dict:
    """Rank 0's phases, peak and gate metrics from its quantkit.json."""
    target = report["targets"][0]
    timings = {**report.get("timings", {}), **target.get("timings", {})}
    metrics = target.get("metrics") or {}
    phases = {key: timings[key] for key in ("baseline_s", "quantize_s", "eval_s", "total_s") if key in timings}
    return {"phases": phases, "gate_s": round(phases.get("baseline_s", 0) + phases.get("eval_s", 0), 2),
            "report_peak_rss_mib": round(target.get("peak_rss_bytes", 0) / 2**20) or None,
            "metrics": {key: metrics.get(key) for key in ("kld_mean", "kld_p99", "top1", "ppl_increase", "positions")}}


def error_message(text: str) -> str:
    """The first `error: ...` line quantkit printed (every rank prints the same), without the prefix."""
    for line in text.splitlines():
        if line.startswith("error: "):
            return line.removeprefix("error: ").strip()
    return text.strip().splitlines()[-1] if text.strip() else ""


# ---------------------------------------------------------------- artifact against the one-process artifact


def step_difference(q1, scale1, zero1, q2, scale2, zero2, groups1=None, groups2=None) -> dict:
    """Two quantized [out, in] weights (ints, per-group scales [out, G] and zero points or None, and the
    group of each input column; None: contiguous groups) compared: the share of int values that differ,
    the largest |w2 - w1| in steps of the first weight's scale (after dequantizing each), and the share of
    scales that differ with their largest relative difference."""
    import torch

    def dequantized(q, scale, zero, groups):
        index = groups if groups is not None else column_groups(q.shape[1], scale.shape[1])
        s = scale.float()[:, index]
        z = zero.float()[:, index] if zero is not None else 0.0
        return (q.float() - z) * s, s

    w1, s1 = dequantized(q1, scale1, zero1, groups1)
    w2, _ = dequantized(q2, scale2, zero2, groups2)
    steps = ((w2 - w1).abs() / s1.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item()  # a scale may be
    # negative (auto-round tunes its sign)
    scales_differ = scale1 != scale2
    relative = ((scale2.float() - scale1.float()).abs() / scale1.float().abs().clamp_min(1e-30)).max().item()
    return {"values": q1.numel(), "ints_changed": int((q1 != q2).sum()), "max_steps": steps,
            "scales": scale1.numel(), "scales_changed": int(scales_differ.sum()), "max_scale_rel": relative}


def column_groups(columns: int, groups: int):
    """Each input column's group for `groups` contiguous groups."""
    import torch

    size = -(-columns // groups)
    return torch.arange(columns) // size


def merge_differences(parts: dict[str, dict]) -> dict:
    """The per-module differences added up: totals, the largest steps and scale difference, and where."""
    if not parts:
        return {}
    worst = max(parts, key=lambda name: parts[name]["max_steps"])
    total = {key: sum(p[key] for p in parts.values()) for key in ("values", "ints_changed", "scales", "scales_changed")}
    layers: dict[int, dict] = {}
    for name, p in parts.items():
        found = re.search(r"\.layers\.(\d+)\.", name)
        if found:
            layer = layers.setdefault(int(found.group(1)), {"values": 0, "ints_changed": 0, "max_steps": 0.0})
            layer.update(values=layer["values"] + p["values"], ints_changed=layer["ints_changed"] + p["ints_changed"],
                         max_steps=max(layer["max_steps"], p["max_steps"]))
    return {**total, "max_steps": parts[worst]["max_steps"], "worst_module": worst,
            "max_scale_rel": max(p["max_scale_rel"] for p in parts.values()),
            "modules_changed": sum(1 for p in parts.values() if p["ints_changed"] or p["scales_changed"]),
            "by_layer": [{"layer": index, **layers[index]} for index in sorted(layers)]}


def read_tensors(artifact: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(artifact.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def weight_bits(artifact: Path) -> int:
    qconfig = json.loads((artifact / "config.json").read_text()).get("quantization_config") or {}
    bits = {group["weights"]["num_bits"] for group in (qconfig.get("config_groups") or {}).values()
            if group.get("weights")}
    return bits.pop() if len(bits) == 1 else 4


def unpack_module(tensors: dict, module: str, shape: list[int], bits: int, unpack) -> tuple:
    """(int values [out, in], scales [out, G], zero points [out, G] or None, g_idx or None) of one module."""
    import torch

    scale = tensors[f"{module}.weight_scale"]
    zero = tensors.get(f"{module}.weight_zero_point")
    if zero is not None and zero.dtype == torch.int32:  # packed along the output dimension
        zero = unpack(zero, bits, (shape[0], scale.shape[1]), packed_dim=0)
    return unpack(tensors[f"{module}.weight_packed"], bits, shape), scale, zero, tensors.get(f"{module}.weight_g_idx")


def scaled_weight(tensors: dict, module: str) -> tuple:
    """(values as floats [out, in], scales [out, G], zero points or None) of a weight stored unpacked with its scales:
    int8 (smoothquant) or fp8 values, one scale per output channel, or per block of columns."""
    scale = tensors[f"{module}.weight_scale"]
    scale = scale.reshape(scale.shape[0], -1) if scale.dim() else scale.reshape(1, 1).expand(
        tensors[f"{module}.weight"].shape[0], 1)
    return tensors[f"{module}.weight"].float(), scale, tensors.get(f"{module}.weight_zero_point")


def fp4_weight(tensors: dict, module: str) -> tuple:
    """(FP4 values as floats [out, in], per-16-column scales [out, G] over the global scale, no zero points) of an
    nvfp4-pack-quantized weight (compressed-tensors' unpack_fp4_from_uint8)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed = tensors[f"{module}.weight_packed"]
    values = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=None).float()
    return values, tensors[f"{module}.weight_scale"].float() / tensors[f"{module}.weight_global_scale"].float(), None


def compare_artifacts(one: Path, other: Path) -> dict:
    """`other` against the one-process artifact `one`: every pack-quantized module by step_difference, every
    other tensor by its largest absolute difference."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    bits = weight_bits(one)
    a, b = read_tensors(one), read_tensors(other)
    if a.keys() != b.keys():
        return {"error": f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}"}
    parts, others = {}, 0.0
    for name in sorted(a):
        if name.endswith(".weight_packed") and name.removesuffix("_packed") + "_global_scale" in a:  # nvfp4
            module = name.removesuffix(".weight_packed")
            parts[module] = step_difference(*fp4_weight(a, module), *fp4_weight(b, module))
        elif name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            shape = a[f"{module}.weight_shape"].tolist()
            (q1, s1, z1, g1), (q2, s2, z2, g2) = (unpack_module(t, module, shape, bits, unpack_from_int32)
                                                  for t in (a, b))
            parts[module] = step_difference(q1, s1, z1, q2, s2, z2, g1, g2)
        elif name.endswith(".weight") and name.removesuffix(".weight") + ".weight_scale" in a:  # int8, fp8
            module = name.removesuffix(".weight")
            parts[module] = step_difference(*scaled_weight(a, module), *scaled_weight(b, module))
        elif not any(name.endswith(s) for s in (".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
                                                ".weight_global_scale")):
            if a[name].is_floating_point():
                others = max(others, (a[name].float() - b[name].float()).abs().max().item())
            elif not a[name].equal(b[name]):
                others = float("inf")
    return {**merge_differences(parts), "other_max_abs": others}


# ---------------------------------------------------------------- the gate alone


GATE_LAUNCHES = (Launch(), Launch(threads=1), Launch(per_node=2), Launch(per_node=4))


def gate_rows(model: Path, artifact: Path, args) -> list[dict]:
    """The gate alone on `artifact` for each of GATE_LAUNCHES (the torchrun ones up to --launches' largest),
    --gate-repeats times, the launches taking turns so that a change of the machine's load reaches all of them;
    each row's seconds are the medians of its repeats."""
    largest = max(launch.world for launch in args.launch_list)
    launches = [launch for launch in GATE_LAUNCHES if launch.world <= largest]
    repeats: dict[str, list[dict]] = {launch.key: [] for launch in launches}
    for repeat in range(args.gate_repeats):
        for launch in launches:
            threads = launch.threads_per_rank(args.cores)
            out = args.work / "gate" / f"gate-{launch.key}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.unlink(missing_ok=True)
            program = [__file__, "--gate-child", str(model), str(artifact), str(out), str(args.seq_len),
                       str(args.eval_windows)]
            log(f"gate alone: {launch.label} ({threads} thread(s) per rank), {repeat + 1} of {args.gate_repeats} ...")
            done = run_launch(launch_commands(launch, program, f"bench-ranks-gate-{os.getpid()}"), child_env(threads),
                              args.work / "logs" / f"gate-{launch.key}.log", args.timeout)
            repeats[launch.key].append({**done, **(json.loads(out.read_text()) if out.is_file() else {})})
    return [gate_summary(launch, repeats[launch.key], args.cores) for launch in launches]


def gate_summary(launch: Launch, repeats: list[dict], cores: int) -> dict:
    """One gate-alone row: the medians of the repeats that finished, every repeat kept."""
    import statistics

    row = {"launch": launch.label, "key": launch.key, "world": launch.world,
           "threads_per_rank": launch.threads_per_rank(cores), "repeats": repeats,
           "load": {"start": repeats[0]["load"]["start"], "max": max(r["load"]["max"] for r in repeats),
                    "end": repeats[-1]["load"]["end"]}}
    finished = [r for r in repeats if "gate_s" in r]
    if finished:
        row.update({key: round(statistics.median(r[key] for r in finished), 2)
                    for key in ("baseline_s", "eval_s", "gate_s", "wall_s")})
        row["kld_mean"] = finished[0]["kld_mean"]
    return row


# ---------------------------------------------------------------- the run


def run(args, command: str) -> dict:
    args.work.mkdir(parents=True, exist_ok=True)
    for sub in ("artifacts", "ranks", "logs"):
        (args.work / sub).mkdir(exist_ok=True)
    started = time.time()
    model = the_model(args)
    log(f"model {model} ready in {time.time() - started:.1f} s")
    result = {"model": str(model), "shape": None if args.model else args.shape, "machine": machine(args.cores),
              "command": command, "settings": {"num_samples": args.num_samples, "seq_len": args.seq_len,
                                                "eval_windows": args.eval_windows},
              "date": time.strftime("%Y-%m-%d"), "rows": [], "gate_rows": []}
    for method in args.method_list:
        result["rows"].extend(method_rows(model, method, args))
        save(result, args)
    first = next((r for r in result["rows"] if r["ok"] and r.get("key") == "1"), None)
    artifact = args.gate_artifact or (Path(first["artifact"]) if first else None)
    if args.gate_rows and artifact:
        result["gate_rows"] = gate_rows(model, artifact, args)
        result["gate_artifact"] = first["label"] if not args.gate_artifact else str(artifact)
        save(result, args)
    return result


def machine(cores: int) -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        gib = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        gib = 0
    import torch

    return f"{model or 'CPU'}, {cores} cores, {gib:.0f} GiB, no GPU; torch {torch.__version__}, gloo"


def scrubbed(value, work: str):
    """`value` with the work directory written as WORK (a reference JSON names no private path)."""
    if isinstance(value, str):
        return value.replace(work, "WORK")
    if isinstance(value, list):
        return [scrubbed(v, work) for v in value]
    if isinstance(value, dict):
        return {k: scrubbed(v, work) for k, v in value.items()}
    return value


def save(result: dict, args) -> None:
    """--json: this run alone, or with --append after the runs already there; a run of the same model,
    shape, settings and machine as the last one there is merged into it (merge_runs)."""
    if not args.json:
        return
    mine = scrubbed(result, str(args.work))
    runs = load_runs(args.json) if args.append and args.json.is_file() else []
    if runs and all(runs[-1].get(k) == mine.get(k) for k in ("model", "shape", "settings", "machine")):
        runs[-1] = merge_runs(runs[-1], mine)
    else:
        runs.append(mine)
    args.json.write_text(json.dumps({"runs": runs}, indent=2) + "\n")


def merge_runs(old: dict, new: dict) -> dict:
    """`new`'s rows added to `old`'s (a row of the same method and launch replaced), grouped by method and in
    launch order; `new`'s gate rows where it has some; both commands kept. Artifacts are compared within one
    run only."""
    rows = {(r["method"], r["key"]): r for r in old["rows"]}
    rows.update({(r["method"], r["key"]): r for r in new["rows"]})
    methods = list(dict.fromkeys(method for method, _ in rows))
    ordered = sorted(rows.values(), key=lambda r: (methods.index(r["method"]), launch_order(r["key"])))
    commands = list(dict.fromkeys([*old.get("commands", [old["command"]]), *new.get("commands", [new["command"]])]))
    merged = {**old, "rows": ordered, "commands": commands}
    if new.get("gate_rows"):
        merged.update(gate_rows=new["gate_rows"], gate_artifact=new.get("gate_artifact"))
    return merged


def launch_order(key: str) -> tuple:
    """One process first (the cores' threads, then @T), then one node by ranks, then several nodes."""
    launch = parse_launch(key)
    return launch.nodes > 1, launch.world, launch.threads or 0


def load_runs(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data.get("runs", [data])


# ---------------------------------------------------------------- output


def mib(values: list) -> str:
    return " / ".join(str(v) for v in values) if values else ""


def load_text(load: dict) -> str:
    return f"{load['start']:.1f}–{load['max']:.1f}" if load else ""


def render_rows(rows: list[dict]) -> str:
    """The runs' table: one row per method and launch (a refusal in place of the numbers)."""
    lines = [("| method | launch | threads per rank | wall s | quantize s | gate s (base + artifact) | peak RSS per "
              "rank MiB | PSS of all ranks MiB | KLD mean | load 1 min |"),
             "|---|---|---:|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        head = f"| {r['label']} | {r['launch']} | {r['threads_per_rank']} | {r['wall_s']:.1f} |"
        tail = f" {mib(r.get('rank_peak_rss_mib', []))} | {r.get('pss_peak_mib', '')} |"
        if not r["ok"]:
            outcome = "refused" if refused_before_work(r) else "failed"
            codes = r.get("rank_exit_codes") or []
            exits = (f"exit {codes[0]}" if len(codes) == 1 else f"rank exits {', '.join(map(str, codes))}" if codes
                     else f"exit {', '.join(map(str, r['exit_codes']))}")
            lines.append(f"{head} {outcome} ({exits}) | — |{tail} — | {load_text(r.get('load'))} |")
            continue
        p = r.get("phases", {})
        gate = f"{r['gate_s']:.1f} ({p.get('baseline_s', 0):.1f} + {p.get('eval_s', 0):.1f})"
        kld = (r.get("metrics") or {}).get("kld_mean")
        lines.append(f"{head} {p.get('quantize_s', 0):.1f} | {gate} |{tail} {fmt_kld(kld)} | "
                     f"{load_text(r.get('load'))} |")
    return "\n".join(lines)


def fmt_kld(value) -> str:
    return f"{value:.3e}" if isinstance(value, (int, float)) else "—"


def render_artifacts(rows: list[dict]) -> str:
    """Each artifact against the one-process artifacts of the same method (add_comparisons)."""
    lines = [("| method | launch | against | int values changed | largest weight difference (steps) | first decoder "
              "layer: changed, steps | scales changed | other tensors | KLD mean, this / against | KLD ratio |"),
             "|---|---|---|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        for d in r.get("compared") or []:
            head = f"| {r['label']} | {r['launch']} | {d['against']} |"
            if "error" in d:
                lines.append(f"{head} {d['error']} | | | | | |")
                continue
            ints = f"{d['ints_changed']} of {d['values']} ({100 * d['ints_changed'] / d['values']:.2f}%)"
            first = (d.get("by_layer") or [None])[0]
            layer = (f"{100 * first['ints_changed'] / first['values']:.3f}%, {first['max_steps']:.3g}" if first
                     else "")
            scales = f"{d['scales_changed']} of {d['scales']}"
            if d["scales_changed"]:
                scales += f" (largest {100 * d['max_scale_rel']:.3g}%)"
            other = "identical" if d["other_max_abs"] == 0 else f"max abs {d['other_max_abs']:.3g}"
            klds = f"{fmt_kld(r['metrics'].get('kld_mean'))} / {fmt_kld(d.get('kld_mean'))}"
            lines.append(f"{head} {ints} | {d['max_steps']:.3g} | {layer} | {scales} | {other} | {klds} | "
                         f"{kld_ratio(r['metrics'].get('kld_mean'), d.get('kld_mean'))} |")
    return "\n".join(lines)


def kld_ratio(this, against) -> str:
    """this / against as 1.023x; — where either is missing or the reference is 0."""
    if not isinstance(this, (int, float)) or not isinstance(against, (int, float)) or not against:
        return "—"
    return f"{this / against:.3f}x"


def render_refusals(rows: list[dict]) -> str:
    """Each refused method's message, once."""
    seen = {}
    for r in rows:
        if not r["ok"] and r.get("refusal") and r["method"] not in seen:
            seen[r["method"]] = f"- {r['label']}: {r['refusal']}"
    return "\n".join(seen.values())


def render_gate(rows: list[dict]) -> str:
    """The gate-alone rows: medians of the repeats, every repeat's gate seconds, and the ratio to one process
    with one core's threads (what rank 0 alone would take)."""
    if not rows:
        return ""
    one = next((r for r in rows if r["world"] == 1 and r["threads_per_rank"] == 1), None)
    lines = [("| gate alone | threads per rank | base s | artifact s | gate s | each run s | vs one process, one "
              "core's threads | KLD mean | load 1 min |"), "|---|---:|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        if "gate_s" not in r:
            lines.append(f"| {r['launch']} | {r['threads_per_rank']} | failed | | | | | | |")
            continue
        each = ", ".join(f"{x['gate_s']:.1f}" for x in r.get("repeats", [r]) if "gate_s" in x)
        ratio = f"{r['gate_s'] / one['gate_s']:.2f}x" if one and one.get("gate_s") else ""
        lines.append(f"| {r['launch']} | {r['threads_per_rank']} | {r['baseline_s']:.1f} | {r['eval_s']:.1f} | "
                     f"{r['gate_s']:.1f} | {each} | {ratio} | {fmt_kld(r.get('kld_mean'))} | "
                     f"{load_text(r.get('load'))} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    s = result["settings"]
    parts = [f"{result['model']}" + (f" (shape {result['shape']})" if result.get("shape") else "")
             + f"; {s['num_samples']} x {s['seq_len']} calibration tokens, {s['eval_windows']} held-out windows; "
             f"{result['machine']}; {result.get('date', '')}", "", render_rows(result["rows"])]
    refusals = render_refusals(result["rows"])
    if refusals:
        parts += ["", "Refused on ranks (each rank's message):", "", refusals]
    artifacts = render_artifacts(result["rows"])
    if artifacts.count("\n") > 1:
        parts += ["", "Against the one-process artifacts:", "", artifacts]
    if result.get("gate_rows"):
        parts += ["", f"The gate alone ({result.get('gate_artifact', '')}, one-process artifact):", "",
                  render_gate(result["gate_rows"])]
    return "\n".join(parts)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=SHAPE_125M, help="H,LAYERS,FFN,HEADS,KV,VOCAB (default: %(default)s)")
    parser.add_argument("--model", type=Path, default=None, help="an existing checkpoint instead of --shape")
    parser.add_argument("--methods", default="gptq,gptq-actorder,awq,autoround",
                        help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--launches", default="1,1@1,2,4,2x1",
                        help="N: one node of N ranks (1: one process, no torchrun); MxN: M nodes of N ranks; "
                        "@T: T threads per rank instead of the cores shared (default: %(default)s)")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--no-gate-rows", dest="gate_rows", action="store_false", help="skip the gate-alone rows")
    parser.add_argument("--gate-repeats", type=int, default=3, help="runs of each gate-alone launch (the median)")
    parser.add_argument("--gate-artifact", type=Path, default=None,
                        help="the gate-alone rows on this artifact (default: the first method's one-process one)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="threads per node (default: the cores)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds after which a launch is stopped and recorded as timed out (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-ranks")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--append", action="store_true",
                        help="keep the runs already in --json (this run's rows merged into the last one when its "
                        "model and settings are the same)")
    parser.add_argument("--render", type=Path, default=None, help="print the tables of a JSON written before")
    args = parser.parse_args(argv)
    args.method_list = [m for m in args.methods.split(",") if m]  # none: the gate-alone rows only
    if args.gate_artifact:
        args.gate_artifact = args.gate_artifact.expanduser().resolve()
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}")
    try:
        launches = [parse_launch(text) for text in args.launches.split(",") if text]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    # the one-process run with the cores' threads, which every other artifact is compared with, comes first
    args.launch_list = [Launch(), *dict.fromkeys(launch for launch in launches if launch != Launch())]
    args.work = args.work.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-child"]:
        rank_child(argv[1:])
        return 0
    if argv[:1] == ["--gate-child"]:
        gate_child(argv[1:])
        return 0
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_signal)
    if args.render:
        print("\n\n".join(render(run) for run in load_runs(args.render)))
        return 0
    result = run(args, "python scripts/bench_ranks.py " + shlex.join(argv))
    print(render(scrubbed(result, str(args.work))))
    return 0


def stop_on_signal(signum, _frame) -> None:
    """SIGTERM as an exception, so that the running launch is stopped on the way out (run_launch)."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
