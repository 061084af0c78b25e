"""llama.cpp's llama-server: how serve-check starts it and what it asks.

llama-server returns no log-probs for prompt tokens (tools/server/README.md, POST /completion: only
`completion_probabilities`, one entry per generated token). So each prediction is one request: the
prompt is the window's first j+1 token ids, n_predict 1, n_probs k, cache_prompt (the slot keeps the
shared prefix, so only the new token is computed). Without post_sampling_probs, the candidates are a
plain softmax of the logits (server-common.cpp get_token_probabilities), whatever the samplers; the
token that followed has a log-prob only when it is among them. A prompt given as token ids gets no
BOS added (the windows start with it already).

- greedy: POST /completion, prompt = token ids, samplers ["top_k"] with top_k 1, ignore_eos,
  return_tokens -> `tokens`.
- streaming: the same with stream; each event's `tokens`; cache_prompt false so prefill is measured.
- tokenize: POST /tokenize, `content` = the text, add_special (BOS as the .gguf's add_bos_token says),
  parse_special -> `tokens` (tools/server/README.md).

Found as `llama-server` in $QUANTKIT_LLAMA_CPP (a bin directory), $QUANTKIT_ENGINES/llama.cpp/bin, the
repository's third_party/llama.cpp/bin, PATH (quantkit.eval.llamacpp.find_binary).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from quantkit.serve.engines import Installed
from quantkit.serve.http import get_json, post_json
from quantkit.serve.process import HOST
from quantkit.serve.settings import Endpoint, ServeOptions
from quantkit.serve.stats import TopK, prefix_topk

NAME = "llama.cpp"
LABEL = "llama.cpp's llama-server"
VARIABLE = "QUANTKIT_LLAMA_CPP"
VARIABLE_HELP = "a llama.cpp `bin` directory holding `llama-server`"
STARTED_AS = "`llama-server --model FILE --ctx-size … --parallel …`"
HEALTH = "/health"
COMPLETION = "/completion"
TOKENIZE = "/tokenize"
STOPS_AT_EOS = False  # requests set ignore_eos
NORMALIZED = True  # log-probs from a float32 log-softmax
MAX_LOGPROBS = None  # any k, or the whole vocabulary
PROMPT_KV_UNSEEN = ""  # a ubatch's keys and values are written to the cache before its attention reads them
GREEDY = {"samplers": ["top_k"], "top_k": 1, "ignore_eos": True, "return_tokens": True}
QUERIED = {
    "prompt_logprobs": "POST /completion per prediction: prompt = the window's first j+1 token ids, n_predict 1, "
                       "n_probs k (the vocabulary size for all), cache_prompt; a plain softmax of the logits "
                       "(no post-sampling); the next token's log-prob only when it is among the top-k",
    "greedy": "POST /completion: prompt = token ids, samplers [top_k], top_k 1, ignore_eos, return_tokens",
    "stream": "POST /completion: stream, samplers [top_k], top_k 1, ignore_eos, cache_prompt false",
    "tokenize": "POST /tokenize: content = the text, add_special, parse_special",
}


def find() -> Installed | None:
    from quantkit.eval.llamacpp import find_binary

    found = find_binary("llama-server")
    return Installed(NAME, found, str(found.parent)) if found else None


def command(engine: Installed, model: Path, port: int, options: ServeOptions) -> list[str]:
    slots = max(1, options.concurrency)
    threads = ["--threads", str(options.threads)] if options.threads else []
    return [str(engine.executable), "--model", str(model), "--host", HOST, "--port", str(port),
            "--ctx-size", str(options.max_model_len * slots), "--parallel", str(slots), "--no-webui", *threads,
            *options.kv_flags]


def environment(options: ServeOptions) -> dict[str, str]:
    return {}


def build_version_file(engine: Installed) -> str | None:
    """What scripts/build_llamacpp.sh wrote in VERSION beside bin/ (its source and llama.cpp commit)."""
    for root in (engine.executable.parent.parent, engine.executable.resolve().parent.parent.parent):
        path = root / "VERSION"
        if path.is_file():
            fields = dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
            commit = fields.get("llama.cpp", "").replace("commit ", "")[:12]
            return f"llama.cpp {commit} (llama-cpp-python {fields.get('llama-cpp-python', '?')} source)"
    return None


def version(endpoint: Endpoint, engine: Installed) -> str:
    """The server's build_info, or the build's VERSION file where the build has no number (b0-unknown)."""
    build = str(get_json(endpoint.url + "/props").get("build_info", "unknown"))
    return build if "unknown" not in build else (build_version_file(engine) or build)


def tokenize(endpoint: Endpoint, installed: Installed, texts: list[str]) -> list[list[int]]:
    """The engine's token ids of each text, BOS added where the .gguf says so, special tokens parsed."""
    return [[int(t) for t in post_json(endpoint.url + TOKENIZE, {"content": text, "add_special": True,
                                                                  "parse_special": True})["tokens"]]
            for text in texts]


def logprob(entry: dict) -> float:
    """An entry's log-prob (-inf where llama-server writes none for a probability of 0)."""
    value = entry.get("logprob")
    return float(value) if value is not None and math.isfinite(float(value)) else -math.inf


def next_token(endpoint: Endpoint, prefix: list[int], k: int) -> list[tuple[int, float]]:
    """The top-k candidates after `prefix`."""
    answer = post_json(endpoint.url + COMPLETION, {
        "prompt": prefix, "n_predict": 1, "n_probs": k or endpoint.vocab_size, "cache_prompt": True,
        **GREEDY})
    probs = answer.get("completion_probabilities") or [{}]
    return [(int(e["id"]), logprob(e)) for e in probs[0].get("top_logprobs", [])]


def prompt_topk(endpoint: Endpoint, windows: list[list[int]], k: int,
                progress: Callable[[str], None]) -> TopK:
    """Top-k log-probs of every next-token prediction of the windows, one request per prediction."""
    return prefix_topk(lambda prefix: next_token(endpoint, prefix, k), windows, "llama-server", progress)


def greedy(endpoint: Endpoint, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuations of `steps` tokens (EOS ignored)."""
    body = {"n_predict": steps, "cache_prompt": False, **GREEDY}
    return [[int(t) for t in post_json(endpoint.url + COMPLETION, {"prompt": p, **body})["tokens"]] for p in prompts]


def stream_request(endpoint: Endpoint, prompt: list[int], steps: int) -> tuple[str, dict]:
    return endpoint.url + COMPLETION, {"prompt": prompt, "n_predict": steps, "stream": True,
                                       "cache_prompt": False, **GREEDY}


def stream_tokens(event: dict) -> int:
    """Generated tokens carried by one streamed event."""
    return len(event.get("tokens") or [])
