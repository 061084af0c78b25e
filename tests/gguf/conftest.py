"""Session fixtures of the GGUF tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf.helpers import load_script, save_f16_copy


@pytest.fixture(scope="session")
def micro(micro_model) -> Path:
    """The session's micro model (tests/conftest.py; read-only here)."""
    return micro_model


@pytest.fixture(scope="session")
def micro_f16(micro, tmp_path_factory) -> Path:
    """The micro model stored in f16 (an F16 GGUF of it holds exactly its values)."""
    return save_f16_copy(micro, tmp_path_factory.mktemp("gguf-micro16") / "micro16")


@pytest.fixture(params=["numba", "numpy"])
def backend(request, monkeypatch):
    """Run a test with the numba kernels and with the numpy ones (the reference they are checked against)."""
    from quantkit.gguf import quants

    monkeypatch.setattr(quants, "BACKEND", request.param)
    return request.param


@pytest.fixture(scope="module")
def ggml():
    """(scripts/make_gguf_golden, its ctypes handle on libggml-base.so); skipped without a llama.cpp build."""
    harness = load_script("make_gguf_golden")
    lib = harness.load_ggml()
    if lib is None:
        pytest.skip("llama.cpp build not found: run scripts/build_llamacpp.sh")
    return harness, lib
