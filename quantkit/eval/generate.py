"""Greedy generation on any forward quantkit has, and "flips": where an artifact's greedy
continuation of a held-out prompt first leaves the base's.

A logits function (evaluate.LogitsFn: ids (b, L) -> logits (b, L, vocab)) is all it needs: the
whole sequence is run again for each new token (no KV cache), so the streamed forwards of a .gguf
or a compressed-tensors checkpoint generate exactly as they score. Prompts are right-padded in a
batch; a causal model's logits at a row's last real position do not see the padding after it.

flips (Unsloth's "answer flips", per token): for each prompt, the tokens from the first one where
the artifact's greedy continuation differs from the base's to the end, over the tokens generated;
0 when every continuation is the base's, 1 when each differs from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from quantkit.eval.evaluate import LogitsFn


@dataclass(frozen=True)
class FlipBaseline:
    """The base's greedy continuations of the held-out prompts, once per run."""

    prompts: np.ndarray  # int64 (prompts, prompt_len)
    tokens: np.ndarray  # int64 (prompts, steps)


def right_padded(rows: list[list[int]]):
    """int64 (b, longest) with each row left-aligned, padded with 0 on the right."""
    import torch

    ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids


def greedy_tokens(logits_fn: "LogitsFn", prompts: list[list[int]], steps: int, stop: int | None = None,
                  done_when: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Greedy continuations of the prompts, `steps` tokens at most each. A row ends at token `stop`
    (not included) or once done_when(its tokens so far) is true."""
    import torch

    rows, out, done = [list(p) for p in prompts], [[] for _ in prompts], [False] * len(prompts)
    with torch.inference_mode():
        for _ in range(steps):
            live = [i for i, d in enumerate(done) if not d]
            if not live:
                break
            logits = logits_fn(right_padded([rows[i] for i in live]))
            for row, index in enumerate(live):
                token = int(logits[row, len(rows[index]) - 1].argmax())
                if stop is not None and token == stop:
                    done[index] = True
                    continue
                rows[index].append(token)
                out[index].append(token)
                done[index] = done_when is not None and done_when(out[index])
    return out


def flip_prompts(windows, count: int) -> np.ndarray:
    """The first half of each of the first `count` held-out windows (cycled when there are fewer)."""
    windows = np.asarray(windows)
    picked = [windows[i % len(windows)] for i in range(count)]
    return np.stack(picked)[:, : max(1, windows.shape[1] // 2)].astype(np.int64)


def base_flips(logits_fn: "LogitsFn", windows, count: int, steps: int) -> FlipBaseline:
    prompts = flip_prompts(windows, count)
    return FlipBaseline(prompts, np.asarray(greedy_tokens(logits_fn, prompts.tolist(), steps), dtype=np.int64))


def first_difference(base: np.ndarray, candidate: np.ndarray) -> int:
    """Index of the first token where the two continuations differ (their length when none does)."""
    differ = np.nonzero(base != candidate)[0]
    return int(differ[0]) if len(differ) else len(base)


def flip_share(base: np.ndarray, candidate: np.ndarray) -> float:
    """Share of generated tokens at or after each prompt's first difference (flips, above)."""
    steps = base.shape[1]
    return float(np.mean([(steps - first_difference(b, c)) / steps for b, c in zip(base, candidate)]))


def flips(logits_fn: "LogitsFn", baseline: FlipBaseline, count: int, steps: int) -> float:
    """The artifact's flips on the first `count` prompts and `steps` tokens of the base's continuations
    (greedy continuations are prefixes of longer ones, so one base run serves every target)."""
    candidate = np.asarray(greedy_tokens(logits_fn, baseline.prompts[:count].tolist(), steps), dtype=np.int64)
    return flip_share(baseline.tokens[:count, :steps], candidate)
