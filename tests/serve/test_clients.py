"""The engine clients' parsing, the load test against the stub server, the quantkit.json record, and
the package's place in the layers."""

import ast
import json
import math
import os
import sys
from pathlib import Path

import pytest

from quantkit.serve import llama_server, load, process, record, vllm_server
from quantkit.serve.settings import Endpoint

STUB = Path(__file__).with_name("stub_server.py")
PACKAGE = Path(__file__).resolve().parents[2] / "quantkit" / "serve"

# The shape of vLLM 0.32's prompt_logprobs (measured): None first, then token id -> {logprob, rank, ...},
# the prompt token included even when outside the top-k.
VLLM_PROMPT_LOGPROBS = [
    None,
    {"100": {"logprob": -10.4, "rank": 466, "decoded_token": "~"}, "20": {"logprob": -3.7, "rank": 1},
     "227": {"logprob": -3.8, "rank": 2}},
    {"20": {"logprob": -3.6, "rank": 1}, "227": {"logprob": -3.7, "rank": 2}},
]


def test_vllm_prompt_logprobs_rows():
    rows, targets = vllm_server.position_rows(VLLM_PROMPT_LOGPROBS, [1, 100, 227])
    assert rows[0] == [(100, -10.4), (20, -3.7), (227, -3.8)] and targets == [-10.4, -3.7]
    assert len(rows) == 2


def test_vllm_command_on_a_cpu(tmp_path):
    from quantkit.serve.engines import Installed
    from quantkit.serve.settings import ServeOptions

    python = tmp_path / "python3"
    python.write_text("")
    python.chmod(0o755)
    script = tmp_path / "vllm"
    script.write_text(f"#!{python}\n")
    script.chmod(0o755)
    command = vllm_server.command(Installed("vllm", script, "test"), tmp_path, 8000,
                                  ServeOptions(max_model_len=128, logprobs=0))
    assert command[:4] == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert "--enforce-eager" in command and command[command.index("--max-logprobs") + 1] == "-1"
    assert command[command.index("--host") + 1] == "127.0.0.1"


@pytest.fixture
def stub_server(tmp_path):
    port = process.free_port()
    command = [sys.executable, str(STUB), str(port)]
    with process.running(command, dict(os.environ), port, "/health", tmp_path / "stub.log", 30, "stub") as server:
        yield Endpoint(server.url, tokenizer=None, vocab_size=8)


def test_llama_server_topk_one_request_per_prediction(stub_server):
    topk = llama_server.prompt_topk(stub_server, [[1, 5, 9], [1, 7, 5]], 2, lambda message: None)
    assert topk.ids.tolist() == [[5, 7]] * 4
    assert topk.logprobs[0].tolist() == [-0.5, -1.5] and all(math.isnan(t) for t in topk.target)
    assert llama_server.greedy(stub_server, [[1, 2]], 3) == [[5, 5, 5]]


def test_load_test_times_streamed_tokens(stub_server):
    results = load.load_test(llama_server, stub_server, [[1, 2, 3, 4]], 5, (1, 3), bos=1)
    assert [r.concurrency for r in results] == [1, 3] and results[1].requests == 3
    for r in results:
        assert r.tokens == 5 and r.prompt_tokens == 4
        assert 0 < r.ttft_s < 5 and r.decode_tok_s > 0 and r.throughput_tok_s > 0
        assert r.decode_tok_s < 1000  # 10 ms between the stub's tokens


def test_load_prompts_never_repeat():
    windows = [[1, 10, 11, 12, 13, 14], [1, 20, 21, 22, 23, 24]]
    prompts = load.load_prompts(windows, 4, 0, bos=1) + load.load_prompts(windows, 4, 4, bos=1)
    assert all(p[0] == 1 and sorted(p) == sorted(windows[i % 2]) for i, p in enumerate(prompts))
    assert len({tuple(p) for p in prompts}) == len(prompts)
    assert not any(tuple(p) in {tuple(w) for w in windows} for p in prompts)


def test_record_writes_one_entry_per_engine_atomically(tmp_path):
    path = tmp_path / "quantkit.json"
    assert record.record_result(path, {"engine": {"name": "vllm"}}) is False and not path.exists()
    path.write_text(json.dumps({"schema_version": 1, "targets": []}))
    record.record_result(path, {"engine": {"name": "vllm"}, "passed": True, "vs_base": {"top1": 1.0},
                                "not_recorded": 1})
    record.record_result(path, {"engine": {"name": "llama.cpp"}, "passed": False})
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and set(data["serve_check"]) == {"vllm", "llama.cpp"}
    assert data["serve_check"]["vllm"]["passed"] is True and "not_recorded" not in data["serve_check"]["vllm"]
    assert "checked_at" in data["serve_check"]["llama.cpp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantkit.json"]
    assert record.report_path(tmp_path / "model-Q8_0.gguf") == path


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_serve_imports_point_downward():
    for path in sorted(PACKAGE.glob("*.py")):
        bad = {n for n in imported_modules(path) if n.startswith(("quantkit.run", "quantkit.cli"))}
        assert not bad, f"{path.name} imports {bad}"


def test_library_code_never_prints():
    for path in sorted(PACKAGE.glob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("print", "exit")]
        assert not calls, path.name
