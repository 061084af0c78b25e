"""How serve-check runs a server and reaches it: the options every engine module reads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Never reach the network from an engine: no hub lookups, no usage reports (vLLM sends them by default).
# Set over any value the user's environment has: an engine only ever reads the local artifact.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
# quantkit's own interpreter settings that must not leak into an engine's interpreter.
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


@dataclass(frozen=True)
class ServeOptions:
    """How a server is started and queried.

    logprobs: candidates per position (0: the whole vocabulary where the engine allows it: vLLM with
    prompt_logprobs -1, llama-server with n_probs = vocabulary; mlx_lm.server gives at most 11)."""

    max_model_len: int | None = None  # context the server is started with (None: what the check needs)
    logprobs: int = 20
    concurrency: int = 8  # the most requests served at once
    device: str = "cpu"  # "cpu", "cuda" or "apple": which flags the engine needs (quantkit.serve.support)
    start_timeout: float = 900.0  # seconds until the server must answer its health check
    kv_cache_gib: float = 1.0  # vLLM on a CPU: VLLM_CPU_KVCACHE_SPACE
    threads: int | None = None  # llama-server threads (None: its default)
    kv_flags: tuple[str, ...] = ()  # the KV-cache type's engine flags (quantkit.eval.kv.KvType.flag); (): 16-bit


@dataclass(frozen=True)
class Endpoint:
    """A running server as the clients see it."""

    url: str  # http://127.0.0.1:PORT
    tokenizer: object  # the base's transformers tokenizer (mlx_lm.server takes text, not token ids)
    vocab_size: int  # the model's vocabulary (llama-server: n_probs for the whole of it)
    model: Path | None = None  # what the server serves (mlx-lm: whose tokenizer its python loads)


def engine_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment an engine runs in: this one without quantkit's Python settings, always offline
    (OFFLINE_ENV over the user's values), plus the engine's own settings (a value the user set wins there)."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    for name, value in extra.items():
        env.setdefault(name, value)
    return {**env, **OFFLINE_ENV}
