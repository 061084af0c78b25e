"""The gate's KV-cache measurement: the artifact read with each KV type against the same artifact read with a
16-bit cache (the KV type's own damage over the same weights) and against the 16-bit base (the total), in one
forward per type; `auto` keeps the smallest type that passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantkit.eval.kv import KvType, Shape, bf16_bytes_per_token
from quantkit.eval.kv.attention import attention_configs, registered

DEFAULT_MAX_KLD = 0.01  # --kv-cache auto's bound on a type's own mean KLD when the gate sets no threshold


@dataclass(frozen=True)
class KvRow:
    kind: KvType
    bytes_per_token: float
    own: object  # evaluate.Metrics: against the artifact with a 16-bit cache
    total: object  # evaluate.Metrics: against the 16-bit base
    passed: bool

    def as_dict(self, shape: Shape) -> dict:
        return {"type": self.kind.name, "engine": self.kind.engine, "serve_flags": list(self.kind.flag),
                "bytes_per_token": self.bytes_per_token,
                "saving": 1 - self.bytes_per_token / bf16_bytes_per_token(shape),
                "skipped_layers": list(self.kind.skip), "raw_prefill": self.kind.raw_prefill,
                "notes": list(self.kind.notes), "own": self.own.as_dict(), "total": self.total.as_dict(),
                "passed": self.passed}


def set_attention(model, name: str):
    for config in attention_configs(model):
        config._attn_implementation = name
    return model


def kv_reading(reading, name: str):
    """A Reading (quantkit.eval.stream) whose model's attention is `name`."""
    from quantkit.eval.stream import Reading

    def open_():
        model, source = reading.open()
        return set_attention(model, name), source

    return Reading(reading.config, open_)


def restore(model, config, implementation: str) -> None:
    """The model's (or the reading's config's) own attention again: a reading's model shares its config."""
    if model is not None:
        set_attention(model, implementation)
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        if str(getattr(c, "_attn_implementation", "")).startswith("quantkit_kv_"):
            c._attn_implementation = implementation


def implementation_of(config) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or "sdpa"


def dual_compare(chunks, own, base) -> tuple:
    """(metrics against `own`, metrics against `base`) of one forward's chunks; both baselines stored."""
    from quantkit.eval.evaluate import kl_rows, summarize, target_nll, top1_and_finite

    acc = {"own": ([], [], []), "base": ([], [], [])}
    offset = 0
    for chunk in chunks:
        end = offset + chunk.logprobs.shape[0]
        top1, finite = top1_and_finite(chunk.logprobs)
        nll = target_nll(chunk)
        for key, baseline in (("own", own), ("base", base)):
            kls, nlls, agree = acc[key]
            kls.append(kl_rows(baseline.logprobs[offset:end], chunk.logprobs, finite).cpu().numpy())
            nlls.append(nll)
            agree.append(top1.cpu().numpy() == baseline.top1[offset:end])
        offset = end
    return tuple(summarize(np.concatenate(k), np.concatenate(n), int(np.concatenate(a).sum()), b.nll)
                 for (k, n, a), b in ((acc["own"], own), (acc["base"], base)))


def passes(own, total, gate) -> bool:
    from quantkit.eval.evaluate import gate_verdict

    verdict = gate_verdict(total, gate)
    thresholds = any(c.threshold is not None for c in verdict.checks)
    return verdict.passed and (thresholds or own.kld_mean <= DEFAULT_MAX_KLD)


def measure_types(reading, model, windows, baseline, kinds: list[KvType], shape: Shape, gate, device: str = "cpu",
                  progress=lambda _m: None) -> list[KvRow]:
    """One row per KV type: its bytes per token, its own damage and the total, and whether it passes. The artifact
    is read as the gate reads it: its `reading` (quantkit.formats.gate.artifact_reading), or where it has none, the
    transformers `model` it loads as (load_artifact)."""
    import torch

    from quantkit.eval.evaluate import compare, compute_baseline, model_scorer
    from quantkit.eval.scorers import reading_scorer

    config = reading.config if reading is not None else model.config
    implementation = implementation_of(config)
    prefill = windows.shape[1] // 2

    def scorer(name: str | None):
        if reading is not None:
            return reading_scorer(kv_reading(reading, name) if name else reading, device)
        return model_scorer(set_attention(model, name or implementation))

    progress(f"KV cache: the artifact with a 16-bit cache on {len(windows)} windows of {windows.shape[1]} tokens")
    own_baseline = compute_baseline(scorer(None), windows, spill=False)
    rows = []
    for kind in kinds:
        progress(f"KV cache: {kind.name}")
        with registered(kind, implementation, prefill) as name, torch.inference_mode():
            if baseline.logprobs is not None:
                own, total = dual_compare(scorer(name)(windows), own_baseline, baseline)
            else:
                own, total = compare(scorer(name), windows, own_baseline), compare(scorer(name), windows, baseline)
        restore(model, config, implementation)
        rows.append(KvRow(kind, kind.bytes_per_token(shape), own, total, passes(own, total, gate)))
    return rows


def smallest_passing(rows: list[KvRow]) -> KvRow | None:
    passing = [r for r in rows if r.passed]
    return min(passing, key=lambda r: (r.bytes_per_token, r.own.kld_mean)) if passing else None


def serve_flags(row: KvRow | None) -> list[str]:
    return list(row.kind.flag) if row is not None else []
