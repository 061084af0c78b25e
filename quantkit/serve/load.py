"""A short load test of a running server: time to first token, prefill and decode speed.

Each request streams a greedy continuation of a prompt of held-out tokens, timed on arrival of each
server-sent event (standard library threads and HTTP). At a concurrency c, c requests start together
and the round is timed from the first send to the last event. Per request: ttft = send to the first
generated token, prefill = prompt tokens / ttft, decode = (generated tokens - 1) / (last token - first
token); reported as medians over the round, and throughput = all generated tokens / the round's time.
Prompts are the windows with their body rotated, a different rotation per request and round, so no
prompt repeats one the server has cached (only a BOS prefix is shared).
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from quantkit.serve.engines import Engine
from quantkit.serve.http import post_stream
from quantkit.serve.settings import Endpoint


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int
    tokens: int  # generated
    ttft_s: float  # request sent -> first generated token
    decode_s: float  # first -> last generated token


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    requests: int
    prompt_tokens: int  # per request
    tokens: int  # generated per request (median)
    ttft_s: float  # median
    prefill_tok_s: float  # median per request
    decode_tok_s: float  # median per request
    throughput_tok_s: float  # all generated tokens / the round's wall time

    def as_dict(self) -> dict:
        return asdict(self)


def rotated(window: list[int], shift: int, bos: int | None) -> list[int]:
    """The window with its body (after a leading BOS) rotated left by `shift` tokens."""
    head = 1 if bos is not None and window and window[0] == bos else 0
    body = window[head:]
    shift %= max(1, len(body))
    return window[:head] + body[shift:] + body[:shift]


def load_prompts(windows: list[list[int]], count: int, first: int, bos: int | None) -> list[list[int]]:
    """`count` prompts, requests first..first+count-1 of the test: request g takes window g mod w,
    rotated by 1 + (its use of that window) mod (body length - 1): never the window itself, and no
    prompt repeats while a window is used fewer times than its body has tokens."""
    prompts = []
    for g in range(first, first + count):
        window = windows[g % len(windows)]
        body = len(window) - (1 if bos is not None and window[:1] == [bos] else 0)
        prompts.append(rotated(window, 1 + (g // len(windows)) % max(1, body - 1), bos))
    return prompts


def timed(engine: Engine, endpoint: Endpoint, prompt: list[int], steps: int) -> Timing:
    """Stream one greedy continuation and time it (the engine module builds the request)."""
    url, body = engine.stream_request(endpoint, prompt, steps)
    sent, first, last, count, usage = time.perf_counter(), None, None, 0, None
    for at, event in post_stream(url, body):
        new = engine.stream_tokens(event)
        if new:
            first, last, count = first or at, at, count + new
        usage = event.get("usage") or usage
    tokens = int(usage.get("completion_tokens", count)) if usage else count
    if first is None:
        return Timing(len(prompt), tokens, float("nan"), float("nan"))
    return Timing(len(prompt), tokens, first - sent, last - first)


def summarize(concurrency: int, timings: list[Timing], wall_s: float) -> LoadResult:
    def median(values):
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else float("nan")

    return LoadResult(
        concurrency, len(timings), timings[0].prompt_tokens, int(median([t.tokens for t in timings])),
        median([t.ttft_s for t in timings]),
        median([t.prompt_tokens / t.ttft_s for t in timings if t.ttft_s > 0]),
        median([(t.tokens - 1) / t.decode_s for t in timings if t.decode_s > 0 and t.tokens > 1]),
        sum(t.tokens for t in timings) / wall_s if wall_s > 0 else float("nan"))


def run_round(engine: Engine, endpoint: Endpoint, prompts: list[list[int]], steps: int) -> LoadResult:
    """All prompts at once, one thread each; the pool is left without waiting when interrupted (its
    requests end when the server stops)."""
    pool = ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="serve-check-load")
    try:
        start = time.perf_counter()
        timings = list(pool.map(lambda prompt: timed(engine, endpoint, prompt, steps), prompts))
        return summarize(len(prompts), timings, time.perf_counter() - start)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def load_test(engine: Engine, endpoint: Endpoint, windows: list[list[int]], steps: int,
              concurrencies: tuple[int, ...], bos: int | None, progress=lambda message: None) -> list[LoadResult]:
    """One round per concurrency (module docstring)."""
    results, sent = [], 0
    for concurrency in concurrencies:
        progress(f"load test: {concurrency} concurrent request(s) of {steps} tokens")
        results.append(run_round(engine, endpoint, load_prompts(windows, concurrency, sent, bos), steps))
        sent += concurrency
    return results
