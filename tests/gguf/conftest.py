"""Session fixtures of the GGUF tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf.helpers import save_f16_copy


@pytest.fixture(scope="session")
def micro(micro_model) -> Path:
    """The session's micro model (tests/conftest.py; read-only here)."""
    return micro_model


@pytest.fixture(scope="session")
def micro_f16(micro, tmp_path_factory) -> Path:
    """The micro model stored in f16 (an F16 GGUF of it holds exactly its values)."""
    return save_f16_copy(micro, tmp_path_factory.mktemp("gguf-micro16") / "micro16")
