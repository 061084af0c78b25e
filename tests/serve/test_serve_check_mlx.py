"""serve-check against a real engine in the default suite: mlx_lm.server (mlx-lm, a dev dependency) serves the
micro model's mlx artifact and is measured on one held-out window (tests/serve/test_serve_check_slow.py runs
every installed engine on a trained model)."""

from quantkit.serve import engines
from tests.serve.test_serve_check_slow import check_passed, require, serve_check

FEW = ("--num-windows", "1", "--seq-len", "24", "--gen-prompts", "1", "--gen-tokens", "4", "--load-tokens", "4",
       "--concurrency", "1")


def test_mlx_server_serves_the_micro_artifact_as_gated(cli, micro_mlx4, tmp_path):
    """One server start, 23 next-token requests, one greedy continuation and one streamed request: the engine
    reads the artifact as quantkit does (exit 0), the result is recorded, and no server process is left."""
    require(engines.find_mlx, "mlx-lm", "QUANTKIT_MLX_PYTHON")
    code, data, stderr = serve_check(cli, micro_mlx4, tmp_path, *FEW)
    check_passed(code, data, stderr, micro_mlx4, "mlx")
    assert data["windows"]["count"] == 1 and data["windows"]["positions"] == 23
    assert data["logprobs"] == 11 and not data["logprobs_normalized"]  # mlx_lm.server: at most 11, bfloat16
    assert [c["name"] for c in data["checks"]] == ["reading_kld"]
