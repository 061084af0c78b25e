"""mlx-lm's server (`python -m mlx_lm server`): how serve-check starts it and what it asks.

mlx_lm.server (0.32) takes text only (`prompt` is encoded with the model's tokenizer, BOS included),
returns log-probs of generated tokens only, and at most 11 candidates (`top_logprobs` <= 11). So each
prediction is one request: the prompt is the text of the window's first j+1 tokens, max_tokens 1,
logprobs, top_logprobs min(k, 11). The server runs with --prompt-cache-size 0, so each request computes
its whole prefix: with its cache, mlx_lm.server 0.32.2 kills its generation thread ("Sequence N has an
empty prompt") when a prompt equals a cached sequence (the previous prompt plus the token it generated,
whenever that token is the window's next one). A prefix whose text does
not encode back to the same token ids (a byte-level BPE can merge differently at the cut), or that
the server counts differently (`usage.prompt_tokens`), is not scored. The token that followed has a
log-prob only when it is among the candidates.

Its log-probs are taken in the model's dtype (bfloat16: off by a constant per position, up to 0.37
nats measured), so serve-check measures its KL scale-free and reports but does not check its perplexity.

- greedy: the prompt's text, temperature 0, logprobs -> `logprobs.content[].id`; it stops at EOS
  (there is no ignore_eos), so quantkit's own continuation is cut at EOS too.
- streaming: stream, stream_options.include_usage; events carry text, the usage event the count.
- tokenize: the server has no endpoint for it, so the engine's python loads the served directory's tokenizer
  as mlx_lm.server does (mlx_lm.utils.load_tokenizer) and encodes each text with it (`encode`, as the server
  encodes a prompt).

Found as $QUANTKIT_MLX_PYTHON (a python with mlx_lm), $QUANTKIT_ENGINES/mlx/bin/python, else this
interpreter when it can import mlx_lm.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from quantkit.errors import UnsupportedError
from quantkit.serve.engines import Installed, engines_dir, first_found
from quantkit.serve.http import post_json
from quantkit.serve.process import HOST
from quantkit.serve.settings import Endpoint, ServeOptions, engine_env
from quantkit.serve.stats import TopK, prefix_topk

NAME = "mlx"
LABEL = "mlx-lm's server"
VARIABLE = "QUANTKIT_MLX_PYTHON"
VARIABLE_HELP = "a python that imports `mlx_lm`"
STARTED_AS = "`python -m mlx_lm server --model DIR --prompt-cache-size 0`"
HEALTH = "/health"
COMPLETIONS = "/v1/completions"
TOKENIZE_TIMEOUT_S = 300
TOKENIZE_SCRIPT = ("import json, sys\nfrom pathlib import Path\nfrom mlx_lm.utils import load_tokenizer\n"
                   "tokenizer = load_tokenizer(Path(sys.argv[1]))\n"
                   "print(json.dumps([list(tokenizer.encode(text)) for text in json.load(sys.stdin)]))")
MAX_LOGPROBS = 11  # top_logprobs <= 11: mlx_lm/server.py validate_model_parameters
PROMPT_KV_UNSEEN = ("mlx_lm.server quantizes a request's cache only after --quantized-kv-start tokens, so the prompt "
                    "log-probs it serves read raw keys and values")
STOPS_AT_EOS = True
# Its log-probs are logits - logsumexp(logits) in the model's dtype (bfloat16): off by a constant per
# position (their probabilities sum to 0.89-1.13 on a small Llama), so KL is measured scale-free and the
# perplexity is not checked (quantkit.serve.stats).
NORMALIZED = False
QUERIED = {
    "prompt_logprobs": "POST /v1/completions per prediction: prompt = the text of the window's first j+1 tokens "
                       "(positions whose text does not encode back to the same ids are not scored), max_tokens 1, "
                       "logprobs, top_logprobs min(k, 11); the next token's log-prob only when among them",
    "greedy": "POST /v1/completions: prompt = text, temperature 0, logprobs (token ids); stops at EOS",
    "stream": "POST /v1/completions: prompt = text, stream, stream_options.include_usage; stops at EOS",
    "tokenize": "the engine's python: mlx_lm.utils.load_tokenizer(the served directory).encode(text)",
}


def imports_mlx_lm() -> bool:
    """Whether this interpreter can import mlx_lm (found, not imported)."""
    return importlib.util.find_spec("mlx_lm") is not None


def find() -> Installed | None:
    found = first_found([(VARIABLE, os.environ.get(VARIABLE)),
                         ("QUANTKIT_ENGINES", engines_dir() / "mlx" / "bin" / "python")])
    if found:
        return Installed(NAME, found[1], found[0])
    if imports_mlx_lm():
        return Installed(NAME, Path(sys.executable), "this python")
    return None


def command(engine: Installed, model: Path, port: int, options: ServeOptions) -> list[str]:
    return [str(engine.executable), "-m", "mlx_lm", "server", "--model", str(model), "--host", HOST,
            "--port", str(port), "--prompt-cache-size", "0"]


def environment(options: ServeOptions) -> dict[str, str]:
    return {}


def version(endpoint: Endpoint, engine: Installed) -> str:
    script = "import importlib.metadata as m; print(m.version('mlx-lm'), m.version('mlx'))"
    result = subprocess.run([str(engine.executable), "-c", script], capture_output=True, text=True, timeout=60, check=False)
    words = result.stdout.split()
    return f"mlx-lm {words[0]}, mlx {words[1]}" if len(words) == 2 else "unknown"


def tokenize(endpoint: Endpoint, installed: Installed, texts: list[str]) -> list[list[int]]:
    """Each text encoded by the tokenizer mlx_lm.server loads for the served directory (module docstring)."""
    result = subprocess.run([str(installed.executable), "-c", TOKENIZE_SCRIPT, str(endpoint.model)],
                            input=json.dumps(texts), capture_output=True, text=True, timeout=TOKENIZE_TIMEOUT_S,
                            env=engine_env({}), check=False)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()] or ["no output"]
        raise UnsupportedError(f"mlx-lm could not load the tokenizer of {endpoint.model}: {lines[-1]}",
                               hint="the directory's tokenizer files must load with mlx_lm.utils.load_tokenizer")
    return [[int(t) for t in ids] for ids in json.loads(result.stdout.strip().splitlines()[-1])]


def prompt_text(tokenizer, ids: list[int]) -> str:
    """The text the server encodes back to `ids` (without the BOS its tokenizer adds)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    body = ids[1:] if bos is not None and ids and ids[0] == bos else ids
    return tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encodes_back(tokenizer, text: str, ids: list[int]) -> bool:
    return list(tokenizer(text)["input_ids"]) == list(ids)


def completion(endpoint: Endpoint, body: dict) -> dict:
    return post_json(endpoint.url + COMPLETIONS, {"temperature": 0, "logprobs": True, **body})


def next_token(endpoint: Endpoint, prefix: list[int], k: int) -> list[tuple[int, float]]:
    """The top candidates after `prefix`; [] when its text does not come back as the same ids."""
    text = prompt_text(endpoint.tokenizer, prefix)
    if not encodes_back(endpoint.tokenizer, text, prefix):
        return []
    answer = completion(endpoint, {"prompt": text, "max_tokens": 1,
                                   "top_logprobs": min(k or MAX_LOGPROBS, MAX_LOGPROBS)})
    if answer.get("usage", {}).get("prompt_tokens") != len(prefix):
        return []
    content = (answer["choices"][0].get("logprobs") or {}).get("content") or [{}]
    return [(int(e["id"]), float(e["logprob"])) for e in content[0].get("top_logprobs", [])]


def prompt_topk(endpoint: Endpoint, windows: list[list[int]], k: int,
                progress: Callable[[str], None]) -> TopK:
    """Top candidates of every next-token prediction of the windows, one request per prediction."""
    return prefix_topk(lambda prefix: next_token(endpoint, prefix, k), windows, "mlx_lm.server", progress)


def continuation(endpoint: Endpoint, prompt: list[int], steps: int) -> list[int] | None:
    """The greedy continuation of at most `steps` tokens, ending at EOS (not included); None when the
    prompt's text does not encode back to the same ids."""
    text = prompt_text(endpoint.tokenizer, prompt)
    if not encodes_back(endpoint.tokenizer, text, prompt):
        return None
    content = (completion(endpoint, {"prompt": text, "max_tokens": steps})["choices"][0].get("logprobs") or {})
    return [int(e["id"]) for e in content.get("content") or [] if int(e["id"]) != endpoint.tokenizer.eos_token_id]


def greedy(endpoint: Endpoint, prompts: list[list[int]], steps: int) -> list[list[int] | None]:
    """Greedy continuations (continuation; None for a prompt that cannot be sent as the same ids)."""
    return [continuation(endpoint, prompt, steps) for prompt in prompts]


def stream_request(endpoint: Endpoint, prompt: list[int], steps: int) -> tuple[str, dict]:
    return endpoint.url + COMPLETIONS, {"prompt": prompt_text(endpoint.tokenizer, prompt), "max_tokens": steps,
                                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def stream_tokens(event: dict) -> int:
    """Streamed events carry text, not ids: one per event with text (the usage event gives the count)."""
    return sum(1 for choice in event.get("choices") or [] if choice.get("text"))
