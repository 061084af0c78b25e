"""run(recipe) -> report: the only place that sequences the steps of a quantization run.

check inputs (fast) -> tokenizer + token windows -> [merge LoRA] -> baseline on held-out windows
(once) -> per target: fresh model, quantize into staging, reload from disk, measure, gate ->
all targets pass: write reports and rename staging to OUT; otherwise nothing is written.

Output layout: one target -> OUT is that artifact; several -> OUT/<target name>/ each, plus
OUT/quantkit.json for the whole run.
"""

from __future__ import annotations

import gc
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from quantkit import __version__
from quantkit import export
from quantkit.errors import GateFailedError, InputError
from quantkit.lora import check_adapter
from quantkit.measure import PeakTracker
from quantkit.methods import get_method
from quantkit.model import ModelInfo, check_device, check_generative, check_model_dir, resolve_model, sha256_files
from quantkit.numerics import check_finite
from quantkit.plan import build_plan, ignore_patterns, keeps_lm_head
from quantkit.preflight import check_disk, run_estimate
from quantkit.recipe import Recipe, Target, target_gate, target_options

Progress = Callable[[str], None]


@dataclass
class QuantizeJob:
    """Everything a method needs for one target. The method saves its artifact into out_dir."""

    model: Any
    tokenizer: Any
    info: ModelInfo
    target: Target
    options: Any
    windows: Any  # quantkit.calibration.TokenWindows
    ignore: list[str]
    out_dir: Path
    device: str = "cpu"
    workdir: Path | None = None
    trust_remote_code: bool = False
    extra: dict = field(default_factory=dict)  # method-specific results for the report


@dataclass
class RunOptions:
    model: str
    out: Path
    overwrite: bool = False
    enforce_gate: bool = True
    progress: Progress = lambda message: None


def prepare(recipe: Recipe, opts: RunOptions) -> tuple[ModelInfo, list]:
    """All cheap checks, before any long work: model, device, output, calibration, method options."""
    from quantkit.calibration import validate_source

    info = check_model_dir(resolve_model(opts.model))
    check_generative(info)
    check_not_quantized(info, recipe)
    check_device(recipe.device)
    export.check_output(opts.out, opts.overwrite)
    validate_source(recipe.calibration.source)
    resolved = []
    for target in recipe.targets:
        method = get_method(target.method)
        options = target_options(target)
        if target.ignore and not getattr(method, "SUPPORTS_IGNORE", True):
            raise InputError(f"target '{target.name}': method {target.method} does not take ignore patterns",
                             hint="its type mixture decides every tensor's type; remove `ignore`/--ignore")
        if hasattr(method, "check"):
            method.check(info, options, recipe.calibration)
        resolved.append((target, method, options))
    for path in recipe.lora:
        if not Path(path).is_dir():
            raise InputError(f"LoRA adapter directory not found: {path}")
        check_adapter(Path(path))
    check_disk(opts.out, run_estimate(info, recipe, resolved))
    check_finite([*info.weight_files, *(Path(p) / "adapter_model.safetensors" for p in recipe.lora)])
    return info, resolved


def check_not_quantized(info: ModelInfo, recipe: Recipe) -> None:
    """Quantizing needs full precision; a QLoRA (bitsandbytes) base is fine when adapters are merged."""
    method = (info.config.get("quantization_config") or {}).get("quant_method")
    if not method or (method == "bitsandbytes" and recipe.lora):
        return
    raise InputError(
        f"{info.path} is already quantized ({method}); quantkit quantizes full-precision checkpoints",
        hint="point at the original 16-bit model (a bitsandbytes QLoRA base is accepted together with --lora)",
    )


def run(recipe: Recipe, opts: RunOptions) -> dict:
    """Execute the recipe; returns the report (also written to OUT/quantkit.json)."""
    started = time.time()
    info, resolved = prepare(recipe, opts)
    staging = export.make_staging(opts.out, opts.progress)
    try:
        report = _run_in(staging, recipe, opts, info, resolved)
        report["timings"]["total_s"] = round(time.time() - started, 3)
        _finish(staging, opts, report)
    except BaseException:
        export.discard(staging)
        raise
    return report


def _run_in(staging: Path, recipe: Recipe, opts: RunOptions, info: ModelInfo, resolved) -> dict:
    from quantkit import evaluate
    from quantkit.model import load_tokenizer

    workdir = staging / ".work"
    workdir.mkdir()
    report = base_report(recipe, opts, info)
    if recipe.lora:
        info = merge_lora(info, recipe, workdir, opts.progress)
    tokenizer = load_tokenizer(info, recipe.trust_remote_code)
    windows = make_windows(tokenizer, recipe, opts.progress)
    report["calibration"].update(source_sha256=windows.sha256, calib_windows=len(windows.calib),
                                 eval_windows=len(windows.eval))
    model = load(info, recipe, opts.progress)
    baseline = None
    if len(windows.eval):
        opts.progress(f"baseline: scoring {len(windows.eval)} held-out windows")
        with PeakTracker() as t:
            baseline = evaluate.compute_baseline(evaluate.model_logits_fn(model), windows.eval, workdir=workdir)
        report["timings"]["baseline_s"] = t.seconds
        report["baseline"] = {"ppl": baseline.ppl, "positions": int(baseline.nll.shape[0])}
    single = len(resolved) == 1
    for target, method, options in resolved:
        if model is None:
            model = load(info, recipe, opts.progress)
        out_dir = staging if single else staging / target.name
        out_dir.mkdir(exist_ok=True)
        ignore = ignore_patterns(info, target.ignore, keeps_lm_head(method, options))
        job = QuantizeJob(model, tokenizer, info, target, options, windows, ignore, out_dir, recipe.device, workdir,
                          recipe.trust_remote_code)
        model = None  # the job holds the only reference, so run_target can free it before measuring
        report["targets"].append(run_target(job, method, recipe, baseline, opts))
        del job
        gc.collect()
    report["passed"] = all(t["gate"]["passed"] for t in report["targets"] if t["gate"])
    return report


def run_target(job: QuantizeJob, method, recipe: Recipe, baseline, opts: RunOptions) -> dict:
    """Quantize one target into its staging dir, then reload it from disk and measure it."""
    from quantkit import evaluate
    from quantkit.artifacts import load_for_eval

    target = job.target
    opts.progress(f"[{target.name}] quantizing with {target.method}")
    with PeakTracker() as qt:
        method.quantize(job)
    export.copy_side_files(job.info.path, job.out_dir)
    entry = target_entry(job, method, recipe)
    entry["timings"] = {"quantize_s": qt.seconds}
    entry["peak_rss_bytes"] = qt.peak_rss
    job.model = None
    gc.collect()
    if baseline is not None:
        opts.progress(f"[{target.name}] measuring the artifact against the base")
        with PeakTracker() as et:
            artifact = job.extra.get("artifact_path", job.out_dir)
            candidate = load_for_eval(Path(artifact), job.info.path, job.device, job.trust_remote_code)
            metrics = evaluate.compare(evaluate.model_logits_fn(candidate), job.windows.eval, baseline)
            del candidate
        entry["timings"]["eval_s"] = et.seconds
        entry["peak_rss_bytes"] = max(qt.peak_rss, et.peak_rss)
        gate = target_gate(recipe, target)
        verdict = evaluate.gate_verdict(metrics, gate, enforced=opts.enforce_gate and gate.enabled)
        entry["metrics"] = metrics.as_dict()
        entry["gate"] = verdict.as_dict()
    return entry


def target_entry(job: QuantizeJob, method, recipe: Recipe) -> dict:
    plan = build_plan(job.info, method, job.options, job.ignore)
    kept = sorted({e.role for e in plan if "kept" in e.precision})
    return {
        "name": job.target.name,
        "method": job.target.method,
        "format": method.FORMAT,
        "engine": method.ENGINE,
        "engine_version": _version(method.ENGINE.split()[0]),
        "options": job.options.model_dump(mode="json"),
        "ignore": job.ignore,
        "kept": kept,
        "quantized_modules": sum(1 for e in plan if "kept" not in e.precision),
        "files": [],
        "metrics": None,
        "gate": None,
        **job.extra.get("report", {}),
    }


def _finish(staging: Path, opts: RunOptions, report: dict) -> None:
    """Write reports and publish, or refuse when an enforced gate failed."""
    import shutil

    shutil.rmtree(staging / ".work", ignore_errors=True)
    failed = [t for t in report["targets"] if t["gate"] and not t["gate"]["passed"] and t["gate"]["enforced"]]
    if failed:
        names = ", ".join(f"{t['name']} ({', '.join(t['gate']['failed'])})" for t in failed)
        raise GateFailedError(f"quality gate failed for {names}; nothing was written to {opts.out}", report=report,
                              hint="see the table above; loosen the gate in the recipe, or use --no-gate")
    single = len(report["targets"]) == 1
    for target in report["targets"]:
        out_dir = staging if single else staging / target["name"]
        target["files"] = sorted(p.name for p in out_dir.iterdir() if p.name != ".work")
        card = export.model_card(report["model"]["path"], target, report)
        (out_dir / "README.md").write_text(card)
        export.write_json(out_dir / "quantkit.json", report if single else {**report, "targets": [target]})
    if not single:
        export.write_json(staging / "quantkit.json", report)
    export.publish(staging, opts.out, opts.overwrite)


def base_report(recipe: Recipe, opts: RunOptions, info: ModelInfo) -> dict:
    import torch
    import transformers

    return {
        "quantkit_version": __version__,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     **{p: _version(p) for p in ("llmcompressor", "compressed-tensors", "gguf", "bitsandbytes")}},
        "recipe": recipe.model_dump(mode="json"),
        "model": {"path": str(info.path), "architecture": info.architecture, "model_type": info.model_type,
                  "parameters": info.num_parameters, "dtype": info.dtype,
                  "sha256": sha256_files(info.weight_files)},
        "calibration": recipe.calibration.model_dump(mode="json"),
        "gate_enforced": opts.enforce_gate,
        "timings": {},
        "targets": [],
    }


def make_windows(tokenizer, recipe: Recipe, progress: Progress):
    from quantkit.calibration import CalibrationSpec, make_windows as build

    c = recipe.calibration
    progress(f"calibration: {c.num_samples} x {c.seq_len} tokens from '{c.source}' (+{c.eval_windows} held out)")
    spec = CalibrationSpec(source=c.source, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed,
                           chat_template=c.chat_template, text_field=c.text_field, eval_windows=c.eval_windows)
    return build(tokenizer, spec)


def load(info: ModelInfo, recipe: Recipe, progress: Progress):
    from quantkit.model import load_model

    progress(f"loading {info.path}")
    return load_model(info, recipe.dtype, recipe.device, recipe.trust_remote_code)


def merge_lora(info: ModelInfo, recipe: Recipe, workdir: Path, progress: Progress) -> ModelInfo:
    """Merge adapters into the full-precision base and continue from the merged checkpoint."""
    from quantkit.lora import merge_adapters

    progress(f"merging {len(recipe.lora)} LoRA adapter(s)")
    merged = merge_adapters(info, recipe.lora, workdir / "merged", recipe.dtype, recipe.trust_remote_code)
    return check_model_dir(merged)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


__all__ = ["QuantizeJob", "RunOptions", "run", "prepare"]
