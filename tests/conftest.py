"""Shared fixtures: tiny local models built once per session (no network, no hub)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> Path:
    """A briefly trained 2-layer Llama (hidden 256, GQA) with a BPE tokenizer; read-only for tests."""
    from quantkit.toy import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("models") / "micro", "micro")


@pytest.fixture(scope="session")
def odd_model(tmp_path_factory) -> Path:
    """The general case: a briefly trained Llama whose widths neither group size 128 nor the k-quant
    block of 256 divides (hidden 192, intermediate 512: only ffn_down's rows take k-quants), with a
    700-token vocabulary and tied embeddings; sharpened so quantization shows (quantkit.toy.sharpen)."""
    from quantkit.toy import make_toy_model
    from quantkit.toy import sharpen

    root = tmp_path_factory.mktemp("models")
    return sharpen(make_toy_model(root / "odd-trained", "odd"), root / "odd")


@pytest.fixture
def model_copy(micro_model, tmp_path) -> Path:
    """A writable copy of the micro model, for tests that damage or edit it."""
    dest = tmp_path / "model"
    shutil.copytree(micro_model, dest)
    return dest


@pytest.fixture(scope="session")
def cli():
    """Run the quantkit CLI in-process: cli("quantize", ...) -> Result with exit_code/stdout/stderr."""
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)

    return invoke

