"""Gemma 3 written for mlx-lm: its gemma3_text makes every sliding_window_pattern-th layer global and reads the
cache of layer pattern - 1, so a checkpoint whose layer_types follow another rule, or that has fewer layers than
the pattern, is refused before work (it would run otherwise, or fail at mlx-lm's first forward)."""

from __future__ import annotations

import pytest

from quantkit.arch.families.gemma import check_mlx_layer_pattern
from quantkit.errors import UnsupportedError

S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("kinds", [[S] * 5 + [F] + [S] * 5 + [F] + [S, S],  # Gemma 3 1B's pattern of 6, cut short
                                   [S, F, S, F],  # a pattern of 2
                                   []])  # no layer_types: mlx-lm's and transformers' defaults agree
def test_layer_kinds_mlx_lm_derives_alike_are_taken(kinds):
    check_mlx_layer_pattern({"layer_types": kinds})


@pytest.mark.parametrize("kinds, words", [([S, S], "needs at least 6 layers"),  # the default pattern, 2 layers
                                          ([S, F, S, S], "a multiple of the sliding pattern, 2 here"),  # not periodic
                                          ([F, S], "a multiple of the sliding pattern, 1 here")])
def test_other_layer_kinds_are_refused_naming_mlx_lm_s_rule(kinds, words):
    with pytest.raises(UnsupportedError, match=words) as info:
        check_mlx_layer_pattern({"layer_types": kinds})
    assert info.value.exit_code == 2 and "--method gguf" in info.value.hint
