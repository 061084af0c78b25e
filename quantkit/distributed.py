"""quantkit runs as one process; a launch by torchrun (several ranks) is refused before any work.

Every rank would otherwise run the whole job on its own and race the others for the output
directory. Splitting one GPTQ run across ranks is llm-compressor's distributed mode, which
quantkit does not drive: on CPU (gloo) it does not reproduce the single-process result, and it has
not been run on GPUs here (README, "Big models").
"""

from __future__ import annotations

from typing import Mapping

from quantkit.errors import UnsupportedError


def world_size(env: Mapping[str, str]) -> int:
    """The number of ranks torchrun (or another launcher of torch.distributed) started; 1 without one."""
    try:
        return int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_single_process(env: Mapping[str, str]) -> None:
    ranks = world_size(env)
    if ranks > 1:
        raise UnsupportedError(f"quantkit runs as one process, but this is one of {ranks} ranks (WORLD_SIZE={ranks}, "
                               "set by torchrun); every rank would run the whole job and race for the output",
                               hint="run `quantkit quantize` without torchrun, on one GPU; for a model larger "
                               "than memory add --offload-dir")
