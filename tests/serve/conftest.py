"""The micro model's mlx artifact, written once per session by `quantkit quantize` (no quantkit.json gate:
--eval-windows 0), for the serve-check tests that run mlx_lm.server or read its recorded answers."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def micro_mlx4(cli, micro_model, tmp_path_factory) -> Path:
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    out = tmp_path_factory.mktemp("serve") / "mlx4"
    result = cli("quantize", micro_model, "--method", "mlx", "--bits", "4", "-o", out, "--eval-windows", "0")
    assert result.exit_code == 0, result.output
    return out
