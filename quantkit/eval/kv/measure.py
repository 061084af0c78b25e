"""The gate's KV-cache measurement: the artifact read with each KV type against the same artifact read with a
16-bit cache (the KV type's own damage over the same weights) and against the 16-bit base (the total), in one
forward per type; `auto` keeps the smallest type that passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantkit.eval.kv import KvType, Shape, bf16_bytes_per_token
from quantkit.eval.kv.attention import attention_configs, registered

DEFAULT_MAX_KLD = 0.01  # --kv-cache auto's bound on a type's own mean KLD when the gate sets no threshold


@dataclass(frozen=True)
class KvRow:
    kind: KvType
    bytes_per_token: float
    own: object  # evaluate.Metrics: against the artifact with a 16-bit cache; None: not measured
    total: object  # evaluate.Metrics: against the 16-bit base; None: not measured
    passed: bool

    @property
    def status(self) -> str:
        """passed | failed | unneeded (not measured: a smaller type passed first, --kv-cache auto)."""
        return "unneeded" if self.own is None else "passed" if self.passed else "failed"

    def as_dict(self, shape: Shape) -> dict:
        return {"type": self.kind.name, "engine": self.kind.engine, "serve_flags": list(self.kind.flag),
                "bytes_per_token": self.bytes_per_token,
                "saving": 1 - self.bytes_per_token / bf16_bytes_per_token(shape),
                "skipped_layers": list(self.kind.skip), "raw_prefill": self.kind.raw_prefill,
                "notes": list(self.kind.notes), "own": self.own.as_dict() if self.own else None,
                "total": self.total.as_dict() if self.total else None, "passed": self.passed, "status": self.status}


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


def base_rows(chunks, windows, base):
    """(offset, the base's float16 rows, the chunk) for a type's chunks: from the kept baseline, or from the base
    scored beside them where the baseline is lockstep (quantkit.eval.evaluate.lockstep_rows)."""
    from quantkit.eval.evaluate import lockstep_rows, stored_rows

    if base.scorer is None:
        return stored_rows(chunks, base)
    return lockstep_rows(base.scorer(windows), chunks, base)


def dual_compare(rows, own, base) -> tuple:
    """(metrics against `own`, metrics against `base`) of one forward's (offset, base rows, chunk) triples
    (base_rows): the artifact's own baseline is kept (in memory or a file), the base's as `rows` bring it."""
    from quantkit.eval.evaluate import Buffers, kl_rows_of, summarize, target_nll, top1_and_finite

    acc, buffers = {"own": ([], [], []), "base": ([], [], [])}, Buffers()
    for offset, base16, chunk in rows:
        end = offset + chunk.logprobs.shape[0]
        top1, finite = top1_and_finite(chunk.logprobs)
        nll = target_nll(chunk)
        divergences = kl_rows_of([own.logprobs[offset:end], base16], chunk.logprobs, finite, buffers)
        for key, kl, baseline in zip(("own", "base"), divergences, (own, base)):
            kls, nlls, agree = acc[key]
            kls.append(kl.cpu().numpy())
            nlls.append(nll)
            agree.append(top1.cpu().numpy() == baseline.top1[offset:end])
    return tuple(summarize(np.concatenate(k), np.concatenate(n), int(np.concatenate(a).sum()), b.nll)
                 for (k, n, a), b in ((acc["own"], own), (acc["base"], base)))


def passes(own, total, gate) -> bool:
    from quantkit.eval.evaluate import gate_verdict

    verdict = gate_verdict(total, gate)
    thresholds = any(c.threshold is not None for c in verdict.checks)
    return verdict.passed and (thresholds or own.kld_mean <= DEFAULT_MAX_KLD)


def search_order(kinds: list[KvType], shape: Shape) -> list[KvType]:
    """The types smallest first (bytes per token; at equal size, the order given)."""
    return sorted(kinds, key=lambda k: k.bytes_per_token(shape))


def measure_types(reading, model, windows, baseline, kinds: list[KvType], shape: Shape, gate, device: str = "cpu",
                  progress=lambda _m: None, until_pass: bool = False, placement=None, own=None,
                  held=None) -> list[KvRow]:
    """One row per KV type: its bytes per token, its own damage and the total, and whether it passes. The artifact
    is read as the gate reads it: its `reading` (quantkit.formats.gate.artifact_reading; resident or streamed as
    the gate's `placement` says, streamed without one; resident, built once for every type), or where it has none, the
    transformers `model` it loads as (load_artifact). `until_pass` (--kv-cache auto): the types are measured
    smallest first, and once one passes the larger types' rows are unneeded (not measured); the others of the
    passing one's size are measured, so the choice is the one measuring every type would make. `own`: the
    artifact's 16-bit-cache reading on these windows where the gate kept it as it measured the artifact
    (evaluate.Keeper: the same reading, placement and attention, so the same numbers); else it is scored first.
    `held`: the reading's resident model the gate held (quantkit.formats.gate.held_artifact), `reading` its own."""
    import torch

    from quantkit.eval.evaluate import compute_baseline, model_scorer
    from quantkit.eval.scorers import STREAMED, HeldReading

    config = reading.config if reading is not None else model.config
    implementation = implementation_of(config)
    prefill = windows.shape[1] // 2
    if held is None and reading is not None:
        held = HeldReading(reading, device, placement or STREAMED, progress)

    def scorer(name: str | None):
        if held is not None:  # resident: one model for every type, its attention set for each
            return held.scorer(kv_reading(reading, name) if name else reading,
                               lambda m: set_attention(m, name or implementation))
        return model_scorer(set_attention(model, name or implementation))

    own_baseline = own
    if own_baseline is None:
        progress(f"KV cache: the artifact with a 16-bit cache on {len(windows)} windows of {windows.shape[1]} tokens")
        own_baseline = compute_baseline(scorer(None), windows)
    rows = []
    for kind in search_order(kinds, shape) if until_pass else kinds:
        if until_pass and any(r.passed and r.bytes_per_token < kind.bytes_per_token(shape) for r in rows):
            rows.append(KvRow(kind, kind.bytes_per_token(shape), None, None, False))
            continue
        progress(f"KV cache: {kind.name}")
        with registered(kind, implementation, prefill) as name, torch.inference_mode():
            own, total = dual_compare(base_rows(scorer(name)(windows), windows, baseline), own_baseline, baseline)
        restore(model, config, implementation)
        rows.append(KvRow(kind, kind.bytes_per_token(shape), own, total, passes(own, total, gate)))
    return rows


def smallest_passing(rows: list[KvRow]) -> KvRow | None:
    passing = [r for r in rows if r.passed]
    return min(passing, key=lambda r: (r.bytes_per_token, r.own.kld_mean)) if passing else None


def serve_flags(row: KvRow | None) -> list[str]:
    return list(row.kind.flag) if row is not None else []


def second_half_kld(model, windows, kind: KvType) -> float:
    """Mean KL divergence of `model` read through `kind` from the same model with a 16-bit cache, over the
    positions llama-perplexity --kl-divergence scores: the second half of each window (quantkit.eval.llamacpp.
    chunk_windows) but its last."""
    import torch

    from quantkit.eval.kv.attention import kv_cache

    ids = torch.as_tensor(windows)
    first, end = ids.shape[1] // 2, ids.shape[1] - 1
    with torch.no_grad():
        base = model(ids).logits[:, first:end].float().log_softmax(-1)
        with kv_cache(model, kind):
            cand = model(ids).logits[:, first:end].float().log_softmax(-1)
    return float((base.exp() * (base - cand)).sum(-1).mean())
