"""quantkit.run.auto: the ladder of --method auto (which candidates, in which order, which skipped and why) and
its search (the smallest passing candidate, in fewer measurements than one per rung), on checkpoint headers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.errors import InputError
from quantkit.io.checkpoint import check_model_dir
from quantkit.run import auto
from quantkit.run.serving import GB

RAM = 24 * GB


@pytest.fixture(scope="module")
def info(micro_model):
    return check_model_dir(micro_model)


def ladder_for(info, text: str, max_kld: float | None = 0.1, **options) -> auto.Ladder:
    return auto.build_ladder(info, auto.parse_for(text, RAM), auto.AutoOptions(**options), max_kld)


def by_label(ladder: auto.Ladder) -> dict[str, auto.Rung]:
    return {r.label: r for r in ladder.rungs}


def test_kv_cache_types_of_vllm_on_a_cpu_are_its_cpu_backends():
    assert auto.kv_engine_for(auto.parse_for("vllm:cpu", RAM)) == "vllm-cpu"
    assert auto.kv_engine_for(auto.parse_for("vllm:L4", RAM)) is None  # the artifact's engine: vllm (GPU types)
    assert auto.kv_engine_for(auto.parse_for("llama.cpp", RAM)) is None


def test_parse_for_reads_engine_and_device_and_defaults():
    assert auto.parse_for("vllm:L4", RAM).device.name == "L4"
    assert auto.parse_for("vllm", RAM).device.name == "H100"
    assert auto.parse_for("llama.cpp", RAM).device.kind == "cpu"
    assert auto.parse_for("mlx", RAM).device.name == "M3-Max-64G"
    assert auto.parse_for("vllm:l4", RAM).device.name == "L4"  # as `quantkit plan --gpu` reads names
    with pytest.raises(InputError, match="unknown engine 'tgi'") as exc:
        auto.parse_for("tgi:L4", RAM)
    assert "vllm, llama.cpp, mlx, transformers" in exc.value.hint and "L4" in exc.value.hint
    with pytest.raises(InputError, match="unknown device 'Z9'"):
        auto.parse_for("vllm:Z9", RAM)


def test_vllm_on_l4_serves_what_its_kernels_take(info):
    rungs = by_label(ladder_for(info, "vllm:L4"))
    assert rungs["fp8 W8A8 (FP8 dynamic)"].status == auto.OPEN  # L4 is Ada (8.9): FP8 runs
    assert rungs["nvfp4 W4A4"].status == "skipped"
    assert "serves it as nvfp4 W4A16" in rungs["nvfp4 W4A4"].why
    assert rungs["nvfp4 W4A16"].status == auto.OPEN
    on_t4 = by_label(ladder_for(info, "vllm:T4"))
    assert on_t4["fp8 W8A8 (FP8 dynamic)"].status == "skipped"
    assert "no vllm kernel serves it on T4" in on_t4["fp8 W8A8 (FP8 dynamic)"].why
    on_b200 = by_label(ladder_for(info, "vllm:B200"))
    assert on_b200["nvfp4 W4A4"].status == auto.OPEN  # Blackwell runs W4A4 itself


def test_equal_sizes_serve_the_faster_kernel_first(info):
    """bitsandbytes nf4 is 2% smaller than the int4 W4A16 formats here, but vLLM's bitsandbytes path is the
    slower kernel: within EQUAL_SIZE the Marlin-class formats come first, data-free before calibrated."""
    ladder = ladder_for(info, "vllm:L4")
    order = [r.label for r in ladder.rungs if r.status == auto.OPEN]
    assert order.index("gptq W4A16") < order.index("bitsandbytes nf4")
    assert order.index("mxfp4 W4A16") < order.index("gptq W4A16") < order.index("awq W4A16")
    sizes = [r.weights for r in ladder.rungs if r.status == auto.OPEN]
    firsts = [sizes[0]]
    for size in sizes[1:]:  # each size at most EQUAL_SIZE above the smallest of its group, groups ascending
        if size > firsts[-1] * (1 + auto.EQUAL_SIZE):
            firsts.append(size)
    assert firsts == sorted(firsts)


def test_candidates_over_the_budget_or_the_device_are_skipped_before_work(info):
    ladder = ladder_for(info, "llama.cpp", max_size="700KB")
    rungs = by_label(ladder)
    assert rungs["gguf Q4_K_M"].status == "skipped" and "over --max-size 700KB" in rungs["gguf Q4_K_M"].why
    assert rungs["gguf Q2_K"].status == auto.OPEN
    tiny = ladder_for(info, "llama.cpp:cpu-0.001G", context=1)  # 1 MB of memory
    fits = [r for r in tiny.rungs if r.status == auto.OPEN]
    assert fits and all(r.weights * 1.1 < 0.9e6 for r in fits)
    assert "offers" in by_label(tiny)["gguf Q8_0"].why


def test_no_candidate_left_is_exit_2_with_the_smallest_size(info):
    ladder = ladder_for(info, "llama.cpp", max_size="10KB")
    with pytest.raises(InputError, match="no format of llama.cpp on cpu fits; the smallest, gguf IQ2_M") as exc:
        auto.check_buildable(ladder)
    assert "--max-size" in exc.value.hint
    mlx_on_gpu = ladder_for(info, "mlx:H100")
    assert all(r.status == "skipped" and "no mlx kernel" in r.why for r in mlx_on_gpu.rungs)


def test_device_room_leaves_the_kv_cache(info):
    small = ladder_for(info, "vllm:L4", context=1024)
    large = ladder_for(info, "vllm:L4", context=8192, batch=4)
    assert small.room > large.room > 0
    assert small.budget() == small.room
    assert ladder_for(info, "vllm:L4", max_size="1MB").budget() == 10**6


# ------------------------------------------------------------------ the search


def chain(bits: list[float], max_kld: float = 0.1) -> auto.Ladder:
    """A ladder of one chain (as GGUF's and MLX's are), sized by its bits."""
    rungs = [auto.Rung(auto.Candidate("gguf", f"t{b}", (("gguf_type", f"t{b}"),), "gguf"), int(b * 1000), b)
             for b in bits]
    return auto.Ladder(auto.parse_for("llama.cpp", RAM), auto.AutoOptions(), rungs, 10**9, max_kld)


def search(ladder: auto.Ladder, kld_of, passes=None) -> list[str]:
    """Run the search with a reading per rung; returns the labels measured, in order."""
    measured = []
    while (rung := auto.next_probe(ladder)) is not None:
        measured.append(rung.label)
        kld = kld_of(rung.bits)
        auto.record(ladder, rung, kld <= ladder.max_kld if passes is None else passes(rung.bits), kld)
    auto.finish(ladder)
    return measured


GGUF_BITS = [3.03, 3.24, 3.28, 3.72, 3.87, 4.11, 4.38, 4.46, 4.73, 4.92, 5.6, 5.72, 6.56, 8.5]


def test_a_chain_following_the_rounding_noise_law_takes_few_measurements():
    ladder = chain(GGUF_BITS)
    measured = search(ladder, lambda b: 0.1 * 4 ** (4.5 - b))  # passes from 4.5 bits up
    assert ladder.chosen.bits == 4.73
    assert len(measured) <= 3 < len(GGUF_BITS)
    skipped = [r for r in ladder.rungs if r.status == "skipped"]
    assert skipped and all("failed the gate" in r.why and "assumed to fail too" in r.why for r in skipped)


def test_a_reading_under_the_kld_bar_that_failed_another_check_bisects():
    ladder = chain(GGUF_BITS)
    measured = search(ladder, lambda b: 1e-5, passes=lambda b: b >= 6)  # top-1 decides, not the KLD
    assert ladder.chosen.bits == 6.56
    assert len(measured) <= 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(2.0, 9.0), min_size=1, max_size=16, unique=True), st.floats(1.5, 9.5),
       st.floats(0.3, 3.0), st.floats(-3.0, 3.0))
def test_the_answer_is_the_smallest_passing_rung_of_a_monotone_chain(bits, threshold, slope, offset):
    """Whatever the readings (any falling law, any bar) and wherever the chain starts passing, the search
    chooses what measuring every rung in order would: the first with bits >= threshold, or none."""
    bits = sorted(bits)
    ladder = chain(bits)
    measured = search(ladder, lambda b: 2 ** (-slope * (b - threshold) + offset), passes=lambda b: b >= threshold)
    expected = next((b for b in bits if b >= threshold), None)
    assert (ladder.chosen.bits if ladder.chosen else None) == expected
    assert len(measured) == len(set(measured)) <= len(bits)
    assert all(r.status in ("passed", "failed", "skipped", "unneeded") for r in ladder.rungs)


def test_needed_bits_refits_the_slope_from_two_readings():
    a = auto.Rung(auto.Candidate("mlx", "a"), bits=3.0, kld=0.4, status="failed")
    b = auto.Rung(auto.Candidate("mlx", "b"), bits=4.0, kld=0.05, status="passed")
    needed = auto.needed_bits([a, b], 0.1)  # log2 KLD falls 3 per bit here: 0.1 is at 3 + 2/3 bits
    assert math.isclose(needed, 3 + 2 / 3, rel_tol=1e-9)
    assert math.isclose(auto.needed_bits([b], 0.1), 4.0 - 0.5)  # one reading: the default 4x per bit


def test_the_guide_raises_the_closest_failed_candidate_within_the_budget():
    ladder = chain([3.0, 4.0, 5.0], max_kld=0.0)
    search(ladder, lambda b: 4.0 ** -b)
    assert ladder.chosen is None
    closest = auto.guide_candidate(ladder)
    assert closest is not None and closest.bits == 5.0
    raised = auto.guided(ladder, closest)
    assert dict(raised.candidate.options)["fallback"] == {"max_size": f"{ladder.budget()}B"}
    assert raised.label == "t5.0 + guide" and ladder.rungs[-1] is raised
    assert auto.next_probe(ladder) is raised
    full = chain([3.0], max_kld=0.0)
    search(full, lambda b: 1.0)
    full.room = 1000
    assert auto.guide_candidate(full) is None and "no room" in full.guide[0]


def test_a_recipe_writes_for_as_given_and_other_targets_fingerprint_as_before():
    from quantkit.run.cache import fingerprint
    from quantkit.run.recipe import Gate, Recipe, validate

    recipe = validate({"targets": [{"name": "a", "method": "auto", "for": "vllm:L4", "options": {"context": 2048}},
                                   {"name": "b", "method": "fp8"}]})
    dumped = recipe.model_dump(mode="json")
    assert dumped["targets"][0]["for"] == "vllm:L4" and "destination" not in dumped["targets"][0]
    assert Recipe.model_validate(dumped).targets[0].destination == "vllm:L4"  # reads back as written
    prints = [fingerprint(recipe, t, Gate(), {}, True)["target"] for t in recipe.targets]
    assert prints[0]["for"] == "vllm:L4" and "for" not in prints[1] and "destination" not in prints[1]


def test_within_one_size_the_smaller_comes_before_the_cheaper_to_measure(info):
    ladder = ladder_for(info, "vllm:L4")
    order = [r.label for r in ladder.rungs if r.status == auto.OPEN]
    sizes = {r.label: r.weights for r in ladder.rungs}
    assert sizes["nvfp4 W4A16"] > sizes["gptq W4A16"]  # NVFP4's fp8 scales per 16 weights: more bytes
    assert order.index("gptq W4A16") < order.index("nvfp4 W4A16") < order.index("bitsandbytes nf4")


def test_a_chosen_rung_the_engine_fails_reopens_what_its_pass_settled():
    """The serving check fails the chosen rung (record with settles=False): the larger rungs its pass had made
    unneeded are open again, and the search goes on from the next one."""
    ladder = chain([3.0, 4.0, 5.0, 6.0], max_kld=None)  # no KLD bar: bisection
    first = auto.next_probe(ladder)
    auto.record(ladder, first, True, 0.01)
    smaller = [r for r in ladder.rungs if r.bits < first.bits and r.status == auto.OPEN]
    for rung in smaller:
        auto.record(ladder, rung, False, 0.5)
    assert auto.answer(ladder) is first and auto.next_probe(ladder) is None
    unneeded = [r for r in ladder.rungs if r.status == "unneeded"]
    assert unneeded and all(r.settled_by is first for r in unneeded)
    auto.record(ladder, first, False, 0.01, "failed the serving check", settles=False)
    assert all(r.status == auto.OPEN and r.settled_by is None for r in unneeded)
    assert [r.status for r in smaller] == ["failed"] * len(smaller)  # the other readings stand
    assert auto.next_probe(ladder) is unneeded[0]


def test_vllm_cpu_skips_candidates_whose_experts_it_cannot_serve(tmp_path):
    """An MoE model's compressed-tensors candidates quantize its experts, which vLLM's CPU build has no kernel for:
    skipped before any work with that reason (the same candidates are open for a GPU)."""
    from quantkit.run.serving import EXPERTS_REFUSED
    from tests.families import test_moe

    info = check_model_dir(test_moe.build(tmp_path / "qwen3_moe", "qwen3_moe"))
    cpu = by_label(ladder_for(info, "vllm:cpu-64G"))
    assert cpu["gptq W4A16"].status == "skipped" and EXPERTS_REFUSED in cpu["gptq W4A16"].why
    assert cpu["fp8 W8A8 (FP8 dynamic)"].status == "skipped" and EXPERTS_REFUSED in cpu["fp8 W8A8 (FP8 dynamic)"].why
    assert by_label(ladder_for(info, "vllm:L4"))["gptq W4A16"].status == auto.OPEN
