"""The run's progress on stderr: phase lines everywhere; steps of long loops as a transient bar on a
terminal, left out of logs."""

from __future__ import annotations

import io

from rich.console import Console

from quantkit.cli.common import ProgressLog


def test_logs_keep_one_line_per_phase():
    buffer = io.StringIO()
    log = ProgressLog(Console(file=buffer, force_terminal=False, width=200))
    log("[t] sensitivity: KL divergence of 3 probe tensors alone on 8 windows")
    for i in range(1, 4):
        log(f"[t] sensitivity: blk.{i}.attn_q.weight alone ({i}/3)")
    log("[t] writing model-Q4_K_M.gguf")
    log.close()
    assert buffer.getvalue().splitlines() == ["· [t] sensitivity: KL divergence of 3 probe tensors alone on 8 windows",
                                              "· [t] writing model-Q4_K_M.gguf"]


def test_a_terminal_shows_steps_as_a_bar_that_goes_away():
    buffer = io.StringIO()
    log = ProgressLog(Console(file=buffer, force_terminal=True, width=120))
    log("[t] converting")
    for i in range(1, 6):
        log(f"[t] converting: blk.{i}.ffn_down.weight -> Q4_K ({i}/5)")
    assert log.bar is not None and log.bar.tasks[0].total == 5 and log.bar.tasks[0].completed == 4
    log("[t] measuring the artifact against the base")
    assert log.bar is None
    assert "measuring the artifact" in buffer.getvalue()
