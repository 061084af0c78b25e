"""quantkit.eval.generate: greedy decoding on a logits function and the flips metric."""

from __future__ import annotations

import numpy as np
import torch

from quantkit.eval import generate

VOCAB = 7


def next_is_plus(k: int):
    """A model whose most likely next token is (token + k) mod VOCAB."""
    def logits(ids):
        return torch.nn.functional.one_hot((ids + k) % VOCAB, VOCAB).float() * 5
    return logits


def test_greedy_tokens_follow_the_argmax_and_stop():
    assert generate.greedy_tokens(next_is_plus(1), [[0], [3, 4]], 4) == [[1, 2, 3, 4], [5, 6, 0, 1]]
    assert generate.greedy_tokens(next_is_plus(1), [[0]], 9, stop=3) == [[1, 2]]
    assert generate.greedy_tokens(next_is_plus(1), [[0]], 9, done_when=lambda out: len(out) == 2) == [[1, 2]]


def test_flip_share_counts_from_the_first_difference():
    base = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert generate.flip_share(base, base) == 0.0
    assert generate.flip_share(base, np.array([[1, 2, 9, 4], [0, 2, 3, 4]])) == (2 / 4 + 4 / 4) / 2


def test_flips_of_the_same_model_are_zero_and_of_another_are_one():
    windows = torch.arange(24).reshape(3, 8) % VOCAB
    baseline = generate.base_flips(next_is_plus(1), windows, 4, 5)
    assert baseline.prompts.shape == (4, 4) and baseline.tokens.shape == (4, 5)
    assert (baseline.prompts[3] == baseline.prompts[0]).all()  # cycled
    assert generate.flips(next_is_plus(1), baseline, 4, 5) == 0.0
    assert generate.flips(next_is_plus(2), baseline, 4, 5) == 1.0
    assert generate.flips(next_is_plus(2), baseline, 2, 3) == 1.0
