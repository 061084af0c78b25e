"""Disk preflight: the estimate (pure) and the refusal before any work."""

from __future__ import annotations

import math
import shutil
from collections import namedtuple

import pytest

from quantkit.errors import InputError
from quantkit.run.preflight import estimate_bytes
from tests.util import FAST_CALIB, kept, leftovers


def test_estimate_adds_artifacts_merged_lora_and_baseline():
    e = estimate_bytes(quantized_params=1000, other_params=100, target_bits=[8.0, 4.0], lora=True,
                       eval_windows=4, seq_len=64, vocab=512)
    assert e.artifacts == (1000 + 200) + (500 + 200)
    assert e.merged_lora == 2 * 1100
    assert e.baseline == 4 * 64 * 512 * 2  # the float16 baseline; logits never go to disk
    assert e.total == e.artifacts + e.merged_lora + e.baseline
    assert estimate_bytes(1000, 100, [8.0], False, 0, 64, 512).total == 1200


Usage = namedtuple("Usage", "total used free")


def test_refuses_when_the_disk_is_too_small(cli, micro_model, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 1000, 1000))
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 2, result.output
    assert "not enough disk space" in result.stderr and "the run writes about" in result.stderr
    assert "0.0 MiB is free" in result.stderr and "artifacts" in result.stderr and "baseline" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_enough_disk_passes_the_check(micro_model, tmp_path, monkeypatch):
    from quantkit.run.preflight import check_disk, estimate_bytes

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 0, 10**12))
    check_disk(tmp_path / "out", estimate_bytes(10**9, 10**8, [8.0], True, 16, 512, 32000))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 0, 10**9))
    with pytest.raises(InputError, match="merged LoRA model"):
        check_disk(tmp_path / "out", estimate_bytes(10**9, 10**8, [8.0], True, 16, 512, 32000))


def test_ram_estimate_streams_the_gate_and_refuses_over_the_limit(micro_model, cli, tmp_path):
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import FIXED_RAM, ram_estimate, unit_bytes
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    recipe = build_recipe(None, "gguf", Overrides(model=str(micro_model)))
    _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
    estimate = ram_estimate(info, recipe, targets)
    others, layers = unit_bytes(info)
    largest = max([*others.values(), *layers.values()])
    model = sum(others.values()) + sum(layers.values())
    assert set(layers) == {"model.layers.0", "model.layers.1"} and "lm_head" in others
    assert "gguf: quantize" not in estimate.steps  # conversion and imatrix stream the checkpoint
    assert estimate.steps["gguf: gate"] < model + 2 * largest + 2**30
    assert estimate.peak > FIXED_RAM
    result = cli("quantize", micro_model, "--method", "fp8", "--max-memory", "100MiB", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "not enough memory" in result.stderr and "--max-memory is 100.0 MiB" in result.stderr
    assert not (tmp_path / "out").exists()


def test_compressed_tensors_gates_stream_unless_the_head_is_quantized(micro_model, tmp_path):
    """A compressed-tensors text decoder's gate holds what the streamed baseline does (a 16-bit
    layer); with its head quantized it loads whole (quantkit.eval.compressed.streams): the decoder and the head
    at its bits, the embedding table as stored."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import largest_matrix, ram_estimate, unit_bytes
    from quantkit.run.recipe import validate

    info = check_model_dir(micro_model)
    model = sum(sum(part.values()) for part in unit_bytes(info))
    for method, options in (("fp8", {}), ("gptq", {}), ("smoothquant", {}), ("fp8", {"quantize_lm_head": True})):
        recipe = validate({"model": str(micro_model), "targets": [{"name": method, "method": method, "options": options}]})
        _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        steps = ram_estimate(info, recipe, targets).steps
        if options:
            others, layers = unit_bytes(info)
            embedding = sum(others.values()) - others["lm_head"]
            whole = embedding + int((model - embedding) * 8 / 16)
            assert steps[f"{method}: gate"] - steps["baseline"] == whole - largest_matrix(info)
        else:
            assert steps[f"{method}: gate"] == steps["baseline"]


def test_a_fallback_adds_its_steps_to_the_estimate(micro_model, tmp_path):
    """--fallback's steps are estimated under the names the report gives their peaks: each requantization as
    the quantize step, each measurement as the gate, the probes as the streamed float32 forward with the
    inputs it records; without a fallback there are none."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import largest_matrix, probe_bytes, ram_estimate, streamed_bytes
    from quantkit.run.recipe import validate

    info = check_model_dir(micro_model)
    for method in ("fp8", "gptq"):
        recipe = validate({"model": str(micro_model), "calibration": {"num_samples": 16, "seq_len": 64},
                           "targets": [{"name": method, "method": method, "options": {"fallback": {}}}]})
        _info, targets, placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        steps = ram_estimate(info, recipe, targets, placement).steps
        assert steps[f"{method}: fallback: eval"] == steps[f"{method}: gate"]
        assert steps[f"{method}: fallback: requantize"] == steps[f"{method}: quantize"]
        recorded = 4 * info.config["num_hidden_layers"] * 16 * 64 * info.config["hidden_size"]
        assert probe_bytes(info, recipe) >= 2 * largest_matrix(info) + streamed_bytes(info, 64, 16) + recorded
        assert steps[f"{method}: fallback: sensitivity"] >= probe_bytes(info, recipe)
        plain = validate({"model": str(micro_model), "targets": [{"name": method, "method": method}]})
        _info, targets, placement = prepare(plain, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        assert not [s for s in ram_estimate(info, plain, targets, placement).steps if "fallback" in s]


def test_vram_estimate_streams_and_refuses_when_the_gpu_is_too_small(micro_model, tmp_path):
    from quantkit.errors import InputError
    from quantkit.eval.stream import ACTIVATION_BYTES, HEAD_SLICE_BYTES
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import FIXED_VRAM, check_vram, largest_matrix, unit_bytes, vram_estimate
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    model = sum(sum(part.values()) for part in unit_bytes(info))
    for method, offload in (("gguf", None), ("gptq", None), ("gptq", str(tmp_path))):
        recipe = build_recipe(None, method, Overrides(model=str(micro_model), offload_dir=offload))
        _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        steps = vram_estimate(info, recipe, targets).steps
        assert steps["baseline"] == 2 * largest_matrix(info) + ACTIVATION_BYTES + 2 * HEAD_SLICE_BYTES
        assert 0 < largest_matrix(info) < model / 4
        if method == "gptq":  # the whole model on the GPU, or one layer with --offload-dir; one layer's Hessians
            layer = max(unit_bytes(info)[1].values())
            held = steps["gptq: quantize"] - ACTIVATION_BYTES - working_set(targets[0], info)
            assert held == (model if offload is None else layer)
    estimate = vram_estimate(info, recipe, targets)
    assert estimate.fixed == FIXED_VRAM
    check_vram(estimate, 0)  # no GPU: nothing to check
    check_vram(estimate, estimate.peak)
    with pytest.raises(InputError, match="not enough GPU memory"):
        check_vram(estimate, estimate.peak - 1)


def test_offloaded_ram_holds_the_norms_and_the_larger_of_a_table_and_a_layer_with_its_hessians(micro_model, tmp_path):
    """--offload-dir keeps decoder layers, the embeddings and the head on disk (quantkit.io.checkpoint.
    offload_device_map); GPTQ adds a float32 Hessian per Linear of a layer and two float32 copies of its largest weight."""
    from quantkit.engines.transformers import offload_device_map
    from quantkit.eval.stream import ACTIVATION_BYTES
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.gptq import quantized_linears
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import ram_estimate, unit_bytes
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    others, layers = unit_bytes(info)
    mapping = offload_device_map(info, "cpu")
    assert {unit for unit, where in mapping.items() if where != "disk"} == {"model.norm"}
    shapes = [shape for name, shape in quantized_linears(info).items() if name.startswith("model.layers.0.")]
    for method in ("gptq", "awq"):
        recipe = build_recipe(None, method, Overrides(model=str(micro_model), offload_dir=str(tmp_path)))
        _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        hessians = working_set(targets[0], info)
        assert hessians == (4 * sum(w * w for _o, w in shapes) + 8 * max(o * w for o, w in shapes)
                            if method == "gptq" else 0)
        held = others["model.norm"] + max(others["model.embed_tokens"], others["lm_head"],
                                          max(layers.values()) + hessians)
        assert ram_estimate(info, recipe, targets).steps[f"{method}: quantize"] == held + ACTIVATION_BYTES + kept(info)


def test_ram_holds_the_decoder_layers_and_one_table_at_a_time_on_the_bounded_path(micro_model, tmp_path):
    """Where the model does not fit whole (ram_estimate's default placement), a text decoder's embeddings and
    head go to disk without --offload-dir (quantkit.run.pipeline.offload_plan): RAM holds the decoder layers
    and norms, plus the larger of one table and GPTQ's Hessians."""
    from quantkit.engines.transformers import offload_device_map
    from quantkit.eval.stream import ACTIVATION_BYTES
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import ram_estimate, unit_bytes
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    others, layers = unit_bytes(info)
    mapping = offload_device_map(info, "cpu", layers=False)
    assert {unit for unit, where in mapping.items() if where == "disk"} == {"model.embed_tokens", "lm_head"}
    recipe = build_recipe(None, "gptq", Overrides(model=str(micro_model)))
    _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
    hessians = working_set(targets[0], info)
    held = others["model.norm"] + sum(layers.values()) + max(others["model.embed_tokens"], others["lm_head"], hessians)
    assert ram_estimate(info, recipe, targets).steps["gptq: quantize"] == held + ACTIVATION_BYTES + kept(info)


def test_a_model_that_fits_is_loaded_whole_with_nothing_on_disk(micro_model, tmp_path, monkeypatch):
    """With room, a method's model is loaded whole (no table offloaded, offload_plan gives no folder) and
    the estimate counts every tensor; with too little room for that, the tables go to disk."""
    from quantkit.eval.stream import ACTIVATION_BYTES
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run import preflight
    from quantkit.run.pipeline import RunOptions, offload_plan, prepare
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    others, layers = preflight.unit_bytes(info)
    recipe = build_recipe(None, "gptq", Overrides(model=str(micro_model)))
    _info, targets, placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
    assert placement.resident and not placement.tables_on_disk  # this machine has room for a tiny model
    with offload_plan(recipe, info, tmp_path, placement) as offload:
        assert offload is None
    whole = sum(others.values()) + sum(layers.values()) + working_set(targets[0], info)
    steps = preflight.ram_estimate(info, recipe, targets, placement).steps
    assert steps["gptq: quantize"] == whole + ACTIVATION_BYTES + preflight.kept_baseline_bytes(info, 512, 16, placement)
    on_disk = next(p for p in preflight.cpu_placements(info, recipe, targets) if p.tables_on_disk)
    tight = preflight.ram_estimate(info, recipe, targets, on_disk).peak
    monkeypatch.setattr(preflight, "available_ram", lambda: tight + preflight.MIN_RAM_HEADROOM)
    placement = preflight.gate_placement(info, recipe, targets)
    assert placement.tables_on_disk
    with offload_plan(recipe, info, tmp_path, placement) as offload:
        assert offload is not None and not offload.layers


def test_parse_size():
    import pytest

    from quantkit.errors import InputError
    from quantkit.units import parse_size

    assert parse_size("16GiB") == 16 * 2**30 and parse_size("500MB") == 500 * 10**6 and parse_size("2G") == 2 * 2**30
    with pytest.raises(InputError):
        parse_size("lots")


def test_ram_estimate_of_fp8_follows_its_path(micro_model, tmp_path):
    """fp8-dynamic reads the checkpoint a slab at a time (quantkit.engines.llmcompressor.model_free): its quantize
    step is one slab's working set, not the model; fp8-static loads the model."""
    from quantkit.engines.llmcompressor.model_free import SLAB_WORKING_SET
    from quantkit.eval.stream import ACTIVATION_BYTES
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import ram_estimate, unit_bytes
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    others, layers = unit_bytes(info)
    in_ram = others["model.norm"] + sum(layers.values()) + max(others["model.embed_tokens"], others["lm_head"])
    largest = max(2 * math.prod(shape) for _dtype, shape in info.tensors.values())  # bf16
    for scheme, expected in (("fp8-dynamic", SLAB_WORKING_SET * largest + kept(info)),
                             ("fp8-static", in_ram + ACTIVATION_BYTES + kept(info))):
        recipe = build_recipe(None, "fp8", Overrides(model=str(micro_model), method_options={"scheme": scheme}))
        _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        assert targets[0].needs_model == (scheme == "fp8-static")
        assert ram_estimate(info, recipe, targets).steps["fp8: quantize"] == expected


def working_set(target, info) -> int:
    return target.method.sizes.working_set(info, target.options)


# ---------------------------------------------------------------- where the gate's forwards run


def deep(info, layers: int = 400):
    """`info` with its first decoder layer's tensors repeated `layers` times: a model far larger than one layer."""
    from dataclasses import replace

    first = {name: value for name, value in info.tensors.items() if name.startswith("model.layers.0.")}
    rest = {name: value for name, value in info.tensors.items() if not name.startswith("model.layers.")}
    repeated = {name.replace("layers.0.", f"layers.{i}.", 1): value for i in range(layers) for name, value in first.items()}
    return replace(info, tensors={**rest, **repeated}, config={**info.config, "num_hidden_layers": layers})


def test_the_gate_is_resident_where_the_run_fits_what_is_available(micro_model, monkeypatch):
    """Resident by default where the run's resident peak fits the memory available now less the headroom;
    streamed, with the numbers, where it does not; --max-memory bounds it (the streamed peak then under the
    bound), and what is available bounds any bound; the line says which, and names no flag."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run import preflight
    from quantkit.run.recipe import Overrides, build_recipe

    info = deep(check_model_dir(micro_model))
    recipe = build_recipe(None, "fp8", Overrides(model=str(micro_model)))
    targets = resolved_targets(recipe, info)
    candidates = preflight.cpu_placements(info, recipe, targets)
    need = min(preflight.ram_estimate(info, recipe, targets, p).peak for p in candidates if p.resident)
    streamed = preflight.ram_estimate(info, recipe, targets, candidates[-1]).peak
    assert streamed < need
    monkeypatch.setattr(preflight, "available_ram", lambda: 64 * 2**30)
    roomy = preflight.gate_placement(info, recipe, targets)
    assert roomy.resident and not roomy.spill and roomy.room > 0
    assert "available now, less 10% headroom" in roomy.why and "--max-memory" not in roomy.why
    bounded = preflight.gate_placement(info, recipe, targets, max_memory=need - 1)
    assert not bounded.resident and f"resident the run would peak at about {preflight._size(need)}" in bounded.why
    assert f"--max-memory {preflight._size(need - 1)}" in bounded.why
    assert preflight.ram_estimate(info, recipe, targets, bounded).peak <= need - 1
    assert bounded.room == 0  # a bounded run's slack is the estimate's error: no logits or forwards beyond it
    assert preflight.gate_placement(info, recipe, targets, max_memory=need).resident
    monkeypatch.setattr(preflight, "available_ram", lambda: need)  # less the headroom: too little
    small = preflight.gate_placement(info, recipe, targets, max_memory=10 * need)
    assert not small.resident and "available now" in small.why
    line = preflight.describe_placement(small, info, 512)
    assert line.startswith("gate: streamed on cpu, ") and "--max-memory" not in line


def test_several_artifacts_reuse_a_kept_baseline(micro_model, monkeypatch):
    """Two targets: the baseline's log-probs kept in memory (one forward of the base, not one per artifact)."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run import preflight
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    one = build_recipe(None, "fp8", Overrides(model=str(micro_model)))
    two = one.model_copy(update={"targets": [one.targets[0], one.targets[0].model_copy(update={"name": "again"})]})
    monkeypatch.setattr(preflight, "available_ram", lambda: 64 * 2**30)
    placement = preflight.gate_placement(info, two, resolved_targets(two, info))
    assert placement.resident and not placement.lockstep and not placement.spill


def test_the_estimates_count_the_logits_at_the_vocabulary_size(micro_model, tmp_path):
    """A 262144-entry vocabulary: each resident step holds a block of the head's logits in the model's dtype
    (quantkit.eval.evaluate.head_block_positions: 32 MiB, 64 positions at 16 bits) per model and a few chunks
    of float32 log-probs of 4 MiB (chunk_positions: 4 positions), a streamed one the scoring's chunks, and a
    kept baseline 2 bytes per position and entry, whatever the window count."""
    import json

    from quantkit.eval.evaluate import chunk_positions, head_block_positions
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.io.safetensors import DTYPE_BYTES
    from quantkit.run import preflight
    from quantkit.run.recipe import Overrides, build_recipe

    big = tmp_path / "big"
    shutil.copytree(micro_model, big)
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**config, "vocab_size": 262144}))
    info, small = check_model_dir(big), check_model_dir(micro_model)
    assert chunk_positions("cpu", 262144) == 4 and chunk_positions("cpu", 512) == 2048
    assert head_block_positions("cpu", 262144, 2) == 64 and head_block_positions("cpu", 262144, 4) == 32
    chunk, size = 4 * 4 * 262144, DTYPE_BYTES[info.dtype]
    head = 32 * 2**20
    assert preflight.chunk_bytes(info, 512, 16) == chunk == 4 * 2**20
    assert preflight.chunk_bytes(info, 2, 1) == 4 * 2 * 262144  # no more positions than there are
    assert preflight.head_block_bytes(info, 512, 16) == head
    assert preflight.head_block_bytes(info, 16, 1) == size * 16 * 262144
    for windows in (4, 64):  # the logits' part does not grow with the windows
        held = preflight.scoring_bytes(0, info, 512, windows, preflight.SCORING_COPIES)
        batch = preflight.batch_bytes(info, 512, windows, preflight.CPU_ACTIVATION_BYTES)
        assert held == head + max(batch + 2 * chunk, preflight.SCORING_COPIES * chunk)
    assert preflight.scoring_bytes(0, info, 512, 4, 4) > preflight.scoring_bytes(0, small, 512, 4, 4) + head // 2
    assert preflight.baseline_bytes(info, 512, 8) == 2 * 8 * 512 * 262144
    recipe = build_recipe(None, "fp8", Overrides(model=str(big), calibration={"eval_windows": 8}))
    targets = resolved_targets(recipe, info)
    candidates = preflight.cpu_placements(info, recipe, targets)
    lockstep = next(p for p in candidates if p.lockstep)
    kept = next(p for p in candidates if p.resident and not p.lockstep and not p.spill)
    filed = next(p for p in candidates if p.resident and p.spill)
    lock, keep, file = (preflight.ram_estimate(info, recipe, targets, p).steps for p in (lockstep, kept, filed))
    assert "baseline" not in lock and min(keep.values()) > preflight.baseline_bytes(info, 512, 8)
    assert lock["fp8: gate"] >= 2 * head + preflight.LOCKSTEP_COPIES * chunk
    assert keep["baseline"] - file["baseline"] == preflight.baseline_bytes(info, 512, 8)  # the file holds them
    assert max(file.values()) < min(max(lock.values()), max(keep.values()))
    assert candidates[0] == filed  # the resident placement that holds least first


def test_a_large_vocabularys_baseline_goes_to_a_file_and_the_line_says_so(micro_model, tmp_path, monkeypatch):
    """A 262144-entry vocabulary's baseline log-probs (8 windows of 512: 2 GiB in float16) are written to a file
    rather than held beside every later step, one artifact or several; a small one's stay in memory."""
    import json

    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run import preflight
    from quantkit.run.recipe import Overrides, build_recipe

    big = tmp_path / "big"
    shutil.copytree(micro_model, big)
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**config, "vocab_size": 262144}))
    monkeypatch.setattr(preflight, "available_ram", lambda: 64 * 2**30)
    for model in (big, micro_model):
        info = check_model_dir(model)
        one = build_recipe(None, "fp8", Overrides(model=str(model), calibration={"eval_windows": 8}))
        two = one.model_copy(update={"targets": [one.targets[0], one.targets[0].model_copy(update={"name": "again"})]})
        for recipe in (one, two):
            placement = preflight.gate_placement(info, recipe, resolved_targets(recipe, info))
            assert placement.resident and not placement.lockstep and placement.spill == (model == big)
            line = preflight.describe_placement(placement, info, 512, 8)
            assert ("in a file" if model == big else "in memory") in line


def resolved_targets(recipe, info):
    from quantkit.run.pipeline import resolve_target

    return [resolve_target(recipe, target, info) for target in recipe.targets]


def test_whole_bytes_by_kind(micro_model):
    from quantkit.formats import all_formats
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.preflight import unit_bytes, whole_bytes

    info = check_model_dir(micro_model)
    others, layers = unit_bytes(info)
    stored = sum(others.values()) + sum(layers.values())
    params = sum(math.prod(shape) for _dtype, shape in info.tensors.values())
    computes_in = {fmt.kind: fmt.gate_dtype for fmt in all_formats()}
    assert whole_bytes(info) == whole_bytes(info, computes_in["compressed-tensors"]) == stored
    assert whole_bytes(info, computes_in["mlx"]) == stored  # dequantized to its scales' (16-bit) dtype
    assert whole_bytes(info, computes_in["gguf"]) == whole_bytes(info, "float32") == 4 * params
    assert whole_bytes(info, "bfloat16") == 2 * params


def test_a_run_says_where_its_gate_runs(cli, micro_model, tmp_path):
    import json

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--max-memory", "4GiB")
    assert result.exit_code == 0, result.output
    assert "gate: resident on cpu, batch " in result.stderr and "--max-memory 4.00 GiB" in result.stderr
    placement = json.loads((out / "quantkit.json").read_text())["gate_placement"]
    assert placement["resident"] is True and placement["device"] == "cpu"


def test_a_gpu_run_keeps_the_model_whole_on_the_gpu_or_onloads_it(micro_model, tmp_path, monkeypatch):
    """Whole on the GPU (no tables on disk) when the run's GPU peak fits; else the model stays in RAM and
    llm-compressor onloads a layer at a time, and the estimate counts one layer."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run import preflight
    from quantkit.run.pipeline import RunOptions, offload_plan, prepare
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    recipe = build_recipe(None, "gptq", Overrides(model=str(micro_model), calibration={"num_samples": 16, "seq_len": 64}))
    _info, targets, _placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
    on_gpu = recipe.model_copy(update={"device": "cuda"})
    monkeypatch.setattr(preflight, "available_vram", lambda: 80 * 2**30)
    whole = preflight.gate_placement(info, on_gpu, targets)
    assert whole.device == "cuda" and whole.resident and not whole.onload
    with offload_plan(on_gpu, info, tmp_path, whole) as offload:
        assert offload is None  # nothing on disk: the GPU has room
    whole_peak = preflight.vram_estimate(info, on_gpu, targets, whole).peak
    onloaded_peak = preflight.vram_estimate(info, on_gpu, targets, whole, onload=True).steps["gptq: quantize"]
    assert onloaded_peak < preflight.vram_estimate(info, on_gpu, targets, whole).steps["gptq: quantize"]
    monkeypatch.setattr(preflight, "available_vram", lambda: int(whole_peak / preflight.GPU_HEADROOM) - 1)
    tight = preflight.gate_placement(info, on_gpu, targets)
    assert tight.onload
    with offload_plan(on_gpu, info, tmp_path, tight) as offload:
        assert offload is not None and not offload.layers  # in RAM, the vocabulary tables on disk


def test_resume_counts_the_saved_progress_and_takes_off_what_is_staged(micro_model, tmp_path, monkeypatch):
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import get_method
    from quantkit.run.preflight import check_disk, with_resume

    info, gguf = check_model_dir(micro_model), get_method("gguf")
    computed, given = gguf.options(gguf_type="Q4_K_M"), gguf.options(gguf_type="Q4_K_M", imatrix="none")
    matrices = sum(4 * shape[-1] for _dtype, shape in info.tensors.values() if len(shape) == 2)
    assert gguf.resume.bytes(info, computed) - gguf.resume.bytes(info, given) == 2 * matrices
    plain = estimate_bytes(1000, 100, [8.0], False, 0, 64, 512)
    resumed = with_resume(plain, info, [(gguf, computed)], staged=500, calibration=None)
    assert resumed.total == plain.total + gguf.resume.bytes(info, computed) - 500
    assert with_resume(plain, info, [(gguf, computed)], staged=10**9, calibration=None).total == 0
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(InputError, match="saved progress for --resume .* less 0.0 MiB an interrupted run already wrote"):
        check_disk(tmp_path / "out", resumed)


def test_a_resume_run_is_refused_with_the_saved_progress_named(cli, micro_model, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 1000, 1000))
    result = cli("quantize", micro_model, "--method", "gguf", "-o", tmp_path / "out", *FAST_CALIB, "--resume")
    assert result.exit_code == 2, result.output
    assert "not enough disk space" in result.stderr and "saved progress for --resume" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_a_sequential_method_counts_its_saved_layers_and_what_each_window_carries(micro_model):
    """--resume with gptq: without calibration windows, the model's bytes (its saved layers); with them, more the
    longer the windows, faster than linearly (a causal mask per window). The estimate against the files a
    killed run leaves: tests/cli/test_resume.py."""
    from types import SimpleNamespace

    from quantkit.io.checkpoint import check_model_dir
    from quantkit.io.safetensors import DTYPE_BYTES
    from quantkit.methods import get_method

    info, gptq = check_model_dir(micro_model), get_method("gptq")
    options = gptq.options()
    weights = sum(DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in info.tensors.values())

    def saved(samples, seq_len):
        return gptq.resume.bytes(info, options, SimpleNamespace(num_samples=samples, seq_len=seq_len)) - weights

    assert saved(0, 512) == 0
    window = {seq_len: saved(5, seq_len) - saved(4, seq_len) for seq_len in (64, 128)}  # one window more
    assert saved(9, 64) - saved(8, 64) == window[64] > 0 and window[128] > 2 * window[64]


def test_an_artifact_loaded_whole_counts_the_tables_it_keeps_16_bit(micro_model):
    """nf4 (bitsandbytes, loaded whole by transformers) keeps a 262144-entry embedding table 16-bit: the gate's and
    the quantize step's estimates hold it as stored and only the decoder layers at 4 bits."""
    from dataclasses import replace

    from quantkit.eval.scorers import Placement
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run import preflight
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    name = next(n for n in info.tensors if n.endswith("embed_tokens.weight"))
    dtype, (_rows, hidden) = info.tensors[name]
    big = replace(info, tensors={**info.tensors, name: (dtype, [262144, hidden])})
    recipe = build_recipe(None, "nf4", Overrides(model=str(micro_model)))
    target = resolved_targets(recipe, big)[0]
    others, layers = preflight.unit_bytes(big)
    whole = preflight.loaded_whole_bytes(target, big)
    assert whole == sum(others.values()) + int(sum(layers.values()) * target.method.sizes.stored_bits(target.options) / 16)
    assert whole > 262144 * hidden * 2  # the table as stored
    steps = preflight.ram_estimate(big, recipe, [target], Placement(True, spill=False)).steps
    assert steps["nf4: quantize"] >= whole + max(layers.values())
    assert working_set(target, big) == whole + max(layers.values())
    assert steps["nf4: gate"] >= whole


def test_a_gate_measuring_kv_types_counts_the_artifacts_kept_reading(micro_model, tmp_path):
    """With --kv-cache the gate keeps the artifact's reading for the types (in memory below the spill size): its
    step holds those rows more, and the KV step, named as the report names its peak, as much."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import baseline_bytes, chunk_bytes, ram_estimate
    from quantkit.run.recipe import validate

    info = check_model_dir(micro_model)
    calibration = {"num_samples": 16, "seq_len": 64, "eval_windows": 2}
    steps = {}
    for kv in (None, "mlx:4"):
        recipe = validate({"model": str(micro_model), "calibration": calibration, "gate": {"kv_cache": kv},
                           "targets": [{"name": "m", "method": "mlx"}]})
        _info, targets, placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        steps[kv] = ram_estimate(info, recipe, targets, placement).steps
    assert steps["mlx:4"]["m: gate"] == steps[None]["m: gate"] + baseline_bytes(info, 64, 2)
    assert steps["mlx:4"]["m: kv cache"] == steps["mlx:4"]["m: gate"] + chunk_bytes(info, 64, 2)
    assert "m: kv cache" not in steps[None]
