"""Offline loading, scoped: the Hugging Face libraries may not reach the network inside `offline()`.

Every load in quantkit also passes `local_files_only=True`; this is the second lock. The hub
library reads HF_HUB_OFFLINE once, at import, into `huggingface_hub.constants`, so setting the
environment variable later changes nothing: `offline()` sets the constant (and the variables,
for libraries imported inside the block) and restores both on exit.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextmanager
def offline() -> Iterator[None]:
    from huggingface_hub import constants

    saved_env = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    saved_constant = constants.HF_HUB_OFFLINE
    os.environ.update({name: "1" for name in OFFLINE_VARIABLES})
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved_constant
        restore_env(saved_env)


def restore_env(saved: dict[str, str | None]) -> None:
    """Put environment variables back as they were (None: it was unset)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
