"""quantkit.engines.llmcompressor.distributed: a torchrun launch read, its limits checked, the windows shared between ranks."""

import pytest

from quantkit.engines.llmcompressor.distributed import (
    ONE_PROCESS_FLAGS,
    Ranks,
    check_launch,
    ranks_from,
    synchronized_gptq,
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


def launch(world=2, targets=(("gptq", "gptq", Options()),), num_samples=8, flags=()):
    from quantkit.methods import get_method

    check_launch(Ranks(0, world), [(name, method, get_method(method).distributed, options)
                                   for name, method, options in targets], num_samples, list(flags))


def test_one_process_is_never_refused():
    launch(world=1, targets=[("fp8", "fp8", None)], num_samples=0, flags=list(ONE_PROCESS_FLAGS))


def test_a_plain_gptq_target_runs_on_several_ranks():
    launch()
    launch(world=8, num_samples=8)


@pytest.mark.parametrize("change, message", [
    (dict(targets=[("q", "gptq", Options()), ("f", "fp8", None)]), "target 'f': fp8 runs in one process only"),
    (dict(targets=[("q", "gptq", Options(fallback={}))]), "gptq with fallback"),
    (dict(targets=[("q", "gptq", Options(auto_precision={}))]), "gptq with auto-precision"),
    *[(dict(flags=[flag]), f"{flag} runs in one process only") for flag in ONE_PROCESS_FLAGS],
])
def test_what_needs_one_process_is_refused(change, message):
    with pytest.raises(UnsupportedError, match=message) as info:
        launch(**change)
    assert info.value.exit_code == 2 and "torchrun ranks" in info.value.message


def test_every_rank_needs_a_window():
    with pytest.raises(InputError, match="3 calibration windows cannot be shared by 4 ranks"):
        launch(world=4, num_samples=3)


def test_the_barrier_goes_in_only_for_several_ranks():
    original = site_function(PATCHES["gptq.broadcast_qparams_and_cleanup"].site)
    with synchronized_gptq(Ranks()):
        assert site_function(PATCHES["gptq.broadcast_qparams_and_cleanup"].site) is original
    with synchronized_gptq(Ranks(1, 2)):
        assert site_function(PATCHES["gptq.broadcast_qparams_and_cleanup"].site) is not original
    assert site_function(PATCHES["gptq.broadcast_qparams_and_cleanup"].site) is original
