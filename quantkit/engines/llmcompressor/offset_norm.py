"""Offset norms (Gemma's and Qwen3.5's `x * (1 + w)`) through llm-compressor's smoothing, exactly.

llm-compressor 0.14.0.1 runs every oneshot inside `norm_calibration_context`, which swaps each offset norm for a
`CalibrationOffsetNorm` holding `1 + w` and, afterwards, writes `weight - 1` back. Both conversions round in the
checkpoint's dtype, and the second one loses the scale of the smoothed channels:

- on entry `1 + w` is rounded to bf16: a weight |w| < 2^-9 comes back as 0 and every small one loses its low bits,
  in every method that runs through oneshot (GPTQ included), smoothed or not;
- after AWQ or SmoothQuant divides a channel by its scale s, `(1 + w) / s - 1` is rounded to bf16. Where s is
  large the stored factor `1 + w'` is small and the rounding of `w'` (near -1, a step of 2^-8) is large against it:
  at s = 100 the channel's factor is off by up to 20%, while the balance layers were multiplied by the exact s.
  A plain norm stores `w / s` with bf16's relative step whatever s is.

Entries of the patch inventory (quantkit.engines.patches) make the smoothing exact:
- `hold_exact` and `restore_exact`: the calibration norm holds `1 + w` in float64 (exact for a bf16 or float16 w)
  and takes 1 off in float64, so the weights a method does not smooth come back bit for bit;
- `representable`: the scales AWQ's search and SmoothQuant chose are replaced, for an offset norm, by the ones
  its stored weight can represent (`representable_scales`): the stored `w'` is what `(1 + w) / s - 1` rounds to,
  and the scale becomes `(1 + w) / (1 + w')`, which the balance layers then take. The function is preserved to
  the balance layers' own rounding, as for a plain norm.
"""

from __future__ import annotations

from collections.abc import Callable

MINIMUM_SMOOTHING_SCALE = 1e-5  # llm-compressor's SmoothQuant clamps its scales from below to this


def representable_scales(one_plus_w, scales, dtype):
    """Per-channel scales s' near `scales` such that the offset weight stored in `dtype` after the division,
    w' = dtype((1 + w) / s - 1), satisfies (1 + w') * s' = 1 + w (to the rounding of s' to the scales' dtype). A channel whose stored factor would
    round to 0 keeps the smallest step away from it (same sign as 1 + w); a zero channel keeps its scale."""
    import torch

    given = scales.dtype
    factor, scales = one_plus_w.double(), scales.double()
    stored = (factor / scales - 1).to(dtype).double()
    step = torch.finfo(dtype).eps
    stored = torch.where(stored == -1, torch.where(factor > 0, -1 + step / 2, -1 - step), stored)
    kept = factor / (1 + stored)
    return torch.where(factor == 0, scales, kept).to(given)


def offset_norm_dtype(layer):
    """The dtype an offset norm's weight is written back in, for llm-compressor's calibration stand-in; else None."""
    from llmcompressor.modeling.offset_norm import CalibrationOffsetNorm

    return layer._orig_dtype if isinstance(layer, CalibrationOffsetNorm) else None


def smoothed_scales(smooth_layer, scales):
    """`scales` as the smooth layer can hold them (representable_scales for an offset norm; else unchanged)."""
    dtype = offset_norm_dtype(smooth_layer)
    if dtype is None:
        return scales
    return representable_scales(smooth_layer.weight.data, scales.to(smooth_layer.weight.device), dtype).to(
        scales.device)


# ---------------------------------------------------------------- the replacements (quantkit.engines.patches)


def hold_exact(init: Callable) -> Callable:
    """CalibrationOffsetNorm.__init__ whose weight is 1 + w in float64, exact for any bf16 or float16 w (float32
    drops the low bits of a |w| below 2^-15): its restore writes weight - 1 back in the original dtype, w again bit
    for bit where nothing smoothed it; its forward multiplies in float32 as before."""
    import torch

    def __init__(self, original, config):
        init(self, original, config)
        self.weight = torch.nn.Parameter(1.0 + original.weight.data.double())

    return __init__


def restore_exact(self, original):
    """CalibrationOffsetNorm.restore taking weight - 1 in float64 (0.14.0.1 rounds the weight to float32 first)."""
    original.weight.data = (self.weight.data.double() - 1.0).to(self._orig_dtype)
    return original


def awq_representable(original: Callable) -> Callable:
    """AWQModifier._compute_best_scale whose scales are the ones the mapping's smooth layer can hold."""

    def _compute_best_scale(self, mapping, fp16_outputs, orig_layer_weights):
        return smoothed_scales(mapping.smooth_layer, original(self, mapping, fp16_outputs, orig_layer_weights))

    return _compute_best_scale


def smoothquant_representable(original: Callable) -> Callable:
    """SmoothQuantModifier._calculate_smoothing_scales whose scales are the ones the smooth layer can hold: the
    mapping is the one whose balance layers these are (the list `_apply_smoothing` passes), and the scales are
    clamped to SmoothQuant's floor first, so its later clamp changes none of them."""

    def _calculate_smoothing_scales(self, balance_layers, activation_scales):
        scales = original(self, balance_layers, activation_scales)
        mapping = next((m for m in self.resolved_mappings_ if m.balance_layers is balance_layers), None)
        if mapping is None or offset_norm_dtype(mapping.smooth_layer) is None:
            return scales
        return smoothed_scales(mapping.smooth_layer, scales.clamp(min=MINIMUM_SMOOTHING_SCALE * (1 + 2 ** -6)))

    return _calculate_smoothing_scales
