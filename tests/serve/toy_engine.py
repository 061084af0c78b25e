"""A toy serving engine: the worked example of docs/development.md ("A new serving engine").

It serves plain transformers checkpoints with transformers itself (tests/serve/toy_server.py, a separate
process) and implements quantkit.serve.engines.Engine. Registered under the name "toy" (the tests add it to
quantkit.serve.engines.ENGINES, and to the engines the transformers format names), serve-check runs it like
any other engine: found, started in its own process group, probed, asked, stopped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from quantkit.serve.engines import Installed, executable
from quantkit.serve.http import get_json, post_json
from quantkit.serve.settings import Endpoint, ServeOptions
from quantkit.serve.stats import TopK, pack_topk

NAME = "toy"
LABEL = "toy server"
VARIABLE = "QUANTKIT_TOY_PYTHON"
VARIABLE_HELP = "a python with torch and transformers"
STARTED_AS = "`python tests/serve/toy_server.py DIR PORT`"
HEALTH = "/health"
STOPS_AT_EOS = False
NORMALIZED = True  # a float32 log-softmax
MAX_LOGPROBS = None  # any k; 0: the whole vocabulary
PROMPT_KV_UNSEEN = "the toy server has no quantized KV cache"
QUERIED = {
    "prompt_logprobs": "POST /logprobs per window: ids, k",
    "greedy": "POST /generate: ids, steps",
    "stream": "POST /generate: ids, steps, stream",
    "tokenize": "POST /tokenize: text",
}
SERVER = Path(__file__).with_name("toy_server.py")


def find() -> Installed | None:
    chosen = executable(os.environ.get(VARIABLE))
    return Installed(NAME, chosen, VARIABLE) if chosen else Installed(NAME, Path(sys.executable), "this python")


def command(installed: Installed, model: Path, port: int, options: ServeOptions) -> list[str]:
    return [str(installed.executable), str(SERVER), str(model), str(port)]


def environment(options: ServeOptions) -> dict[str, str]:
    return {}


def version(endpoint: Endpoint, installed: Installed) -> str:
    return get_json(endpoint.url + "/version")["version"]


def tokenize(endpoint: Endpoint, installed: Installed, texts: list[str]) -> list[list[int]]:
    return [post_json(endpoint.url + "/tokenize", {"text": text})["ids"] for text in texts]


def prompt_topk(endpoint: Endpoint, windows: list[list[int]], k: int, progress: Callable[[str], None]) -> TopK:
    rows, targets = [], []
    for i, ids in enumerate(windows):
        progress(f"toy server log-probs: window ({i + 1}/{len(windows)})")
        answer = post_json(endpoint.url + "/logprobs", {"ids": ids, "k": k})
        rows += [[(int(token), float(value)) for token, value in row] for row in answer["top"]]
        targets += answer["target"]
    return pack_topk(rows, targets)


def greedy(endpoint: Endpoint, prompts: list[list[int]], steps: int) -> list[list[int]]:
    return [post_json(endpoint.url + "/generate", {"ids": p, "steps": steps})["ids"] for p in prompts]


def stream_request(endpoint: Endpoint, prompt: list[int], steps: int) -> tuple[str, dict]:
    return endpoint.url + "/generate", {"ids": prompt, "steps": steps, "stream": True}


def stream_tokens(event: dict) -> int:
    return len(event.get("ids") or [])
