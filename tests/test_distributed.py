"""quantkit.distributed: a launch by torchrun is told apart from a single process."""

import pytest

from quantkit.distributed import check_single_process, world_size
from quantkit.errors import UnsupportedError


@pytest.mark.parametrize("env, ranks", [({}, 1), ({"WORLD_SIZE": "1"}, 1), ({"WORLD_SIZE": "4", "RANK": "3"}, 4),
                                        ({"WORLD_SIZE": "x"}, 1)])
def test_world_size_reads_the_launcher_environment(env, ranks):
    assert world_size(env) == ranks


def test_only_several_ranks_are_refused():
    check_single_process({"WORLD_SIZE": "1", "RANK": "0"})
    with pytest.raises(UnsupportedError, match="one of 8 ranks") as info:
        check_single_process({"WORLD_SIZE": "8"})
    assert info.value.exit_code == 2
