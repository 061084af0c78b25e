"""Serving engines as the proof that an artifact serves as it was gated (`quantkit serve-check`).

An artifact is loaded by the engine that serves its format — vLLM (compressed-tensors), llama.cpp's
llama-server (.gguf), mlx-lm's server (mlx) — as a real server on 127.0.0.1, and measured from the
engine's own log-probabilities, greedy continuations and streamed timings against quantkit's readings.

Modules, one concern each: engines (the Engine protocol and the registry of engines, ENGINES), one module
per engine implementing it (vllm_server, llama_server, mlx_server: how each is found, started and
queried), support (what each serves on this device), process (the server's lifetime), http (stdlib
JSON/SSE), stats (the numbers from top-k log-probs), tokens (the engine's tokenization against the
Hugging Face tokenizer's), load (the load test), check (one run and its verdict: serve_check), record
(the result in quantkit.json). A layer above
quantkit.eval, quantkit.io and quantkit.engines; never imports quantkit.run or quantkit.cli.
"""
