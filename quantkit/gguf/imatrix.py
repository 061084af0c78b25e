"""Importance matrix: per input column, the mean squared activation entering each GGUF matmul.

Computed like llama-imatrix: forward the calibration windows through the model and, for every
linear layer of the decoder blocks (llama-imatrix collects MUL_MAT weights named "blk.*"; the
output head only with --process-output, which quantkit does not do either), sum x_j^2 over all
tokens and count the tokens. Entries are keyed by GGUF tensor names (blk.N.attn_q.weight ...).

Files: llama.cpp's GGUF imatrix (general.type = "imatrix", imatrix.datasets / chunk_count /
chunk_size, tensors "<name>.in_sum2" F32 [ncols, nmat] and "<name>.counts" F32 [1, nmat]) is read
and written; the legacy .dat format is read. The importance vector handed to the quantizer is
in_sum2 / count computed in float32, as llama-quantize's load_imatrix does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantkit.arch.modules import decoder
from quantkit.errors import InputError

SUM_SUFFIX, COUNT_SUFFIX = ".in_sum2", ".counts"


@dataclass
class Imatrix:
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 (nmat, ncols)
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 (nmat,)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False

    def weights(self) -> dict[str, np.ndarray]:
        """{name: importance vector (nmat*ncols,) float32} as llama-quantize computes it."""
        return {name: entry_weights(self.sums[name], self.counts[name]) for name in self.sums}


def entry_weights(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    out = np.ones_like(sums, dtype=np.float32)
    for j, count in enumerate(np.asarray(counts, dtype=np.float32)):
        if count > 0:
            out[j] = sums[j].astype(np.float32) / np.float32(count)
    return out.reshape(-1)


# ------------------------------------------------------------------ compute


def linear_targets(model, config: dict) -> dict[str, str]:
    """{HF module name: GGUF tensor name} for the decoder-block linears."""
    import torch

    from quantkit.gguf.convert import arch_spec, name_map, source_name, split_names, tensor_rule

    tmap, spec = name_map(config), arch_spec(config)
    targets = {}
    for mod_name, module in model.named_modules():
        hf = source_name(mod_name + ".weight", spec)  # a VLM's language_model.* as the converter names it
        if isinstance(module, torch.nn.Linear) and hf is not None:
            rule = tensor_rule(config, hf)
            if rule is not None and rule.pieces is not None:  # pieces with other inputs than the linear's
                continue
            # a split tensor's first piece (split_pieces: the others share its input)
            name = tmap.get_name(split_names(rule, hf)[0], try_suffixes=(".weight",))
            if name is not None and name.startswith("blk."):
                targets[mod_name] = name
    return targets


def split_pieces(config: dict, targets: dict[str, str]) -> dict[str, list[str]]:
    """{first piece: the other pieces} of the linears the family's conversion splits (Granite's shared MLP
    input_linear -> ffn_gate, ffn_up): llama-imatrix records each piece, all of the same input."""
    from quantkit.gguf.convert import name_map, source_name, split_names, tensor_rule

    tmap, out = name_map(config), {}
    for mod_name, first in targets.items():
        hf = source_name(mod_name + ".weight")
        names = split_names(tensor_rule(config, hf), hf) if hf is not None else []
        if len(names) > 1:
            out[first] = [tmap.get_name(n, try_suffixes=(".weight",)) for n in names[1:]]
    return out


def expert_targets(model) -> dict[str, int]:
    """{module name: layer} of transformers' fused expert modules (3-D gate_up_proj / down_proj) that are given the
    routing beside the hidden states (forward(hidden_states, top_k_index, ...)); Llama 4's take the routed rows
    alone, and its family collects them (Gguf.imatrix_inputs)."""
    import re

    targets = {}
    for mod_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        match = re.search(r"layers\.(\d+)\.", mod_name + ".")
        if match and {"gate_up_proj", "down_proj"} <= params.keys() and params["gate_up_proj"].dim() == 3 \
                and takes_routing(module):
            targets[mod_name] = int(match.group(1))
    return targets


def takes_routing(module) -> bool:
    """Whether an experts module's forward takes the router's choice as its second input."""
    import inspect

    return len(inspect.signature(module.forward).parameters) >= 2


def expert_inputs(module, inputs) -> dict[str, list]:
    """Per expert, the rows entering ffn_gate/up_exps and ffn_down_exps (llama-imatrix's MUL_MAT_ID
    collection): the routed tokens' hidden states, and the gated activation (act(gate) * up; the module's own
    gate where transformers' experts have one: GPT-OSS's clamped SwiGLU of interleaved halves) for the down
    projection."""
    import torch

    hidden, top_k = inputs[0].detach().reshape(-1, inputs[0].shape[-1]), inputs[1].reshape(inputs[0].shape[0], -1)
    params = dict(module.named_parameters(recurse=False))
    out: dict[str, list] = {"gate_up": [], "down": []}
    for e in range(params["gate_up_proj"].shape[0]):
        x = hidden[(top_k == e).any(-1)]
        out["gate_up"].append(x.to(torch.float64))
        out["down"].append(gated(module, gate_up_output(module, params, e, x)).to(torch.float64))
    return out


def gate_up_output(module, params: dict, expert: int, x):
    """One expert's gate_up projection of its rows, in the layout transformers' experts state (use_experts_
    implementation's is_transposed: [hidden, 2 x intermediate], and has_bias: gate_up_proj_bias added)."""
    import torch

    weight = params["gate_up_proj"][expert]
    y = x @ weight if getattr(module, "is_transposed", False) else torch.nn.functional.linear(x, weight)
    return y + params["gate_up_proj_bias"][expert] if getattr(module, "has_bias", False) else y


def gated(module, gate_up):
    """The input of the down projection: the experts module's own gate (transformers' _apply_gate: act(gate) * up
    of the concatenated halves by default), act(gate) * up where it has none."""
    if callable(getattr(module, "_apply_gate", None)):
        return module._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def compute(model, windows, config: dict, dataset: str = "quantkit", batch_size: int = 1, device=None) -> Imatrix:
    """Run `windows` (LongTensor (n, seq_len)) through `model`, collecting sums of squares of the
    inputs of the decoder-block linears, under their GGUF tensor names (`linear_targets`).

    `model` may be a layer-streamed one (quantkit.eval.stream: parameters on the meta device, each
    decoder layer's weights read while it runs); pass its execution `device` then.
    """
    import torch

    from quantkit.arch.families.text import text_hparams
    from quantkit.gguf.convert import arch_spec

    targets = linear_targets(model, config)
    sums = {name: None for name in targets.values()}
    counts = {name: 0 for name in targets.values()}
    experts = expert_targets(model)
    expert_sums: dict[str, list] = {}

    def hook(name):
        def fn(_module, inputs, _output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            s = (x * x).sum(0)
            sums[name] = s if sums[name] is None else sums[name] + s
            counts[name] += x.shape[0]
        return fn

    def expert_hook(layer):
        def fn(module, inputs, _output):
            rows = expert_inputs(module, inputs)
            for kind, names in (("gate_up", ("ffn_gate_exps", "ffn_up_exps")), ("down", ("ffn_down_exps",))):
                for tensor in names:
                    add_expert_rows(expert_sums, f"blk.{layer}.{tensor}.weight", rows[kind])
        return fn

    modules = dict(model.named_modules())
    handles = [modules[m].register_forward_hook(hook(n)) for m, n in targets.items()]
    handles += [modules[m].register_forward_hook(expert_hook(layer)) for m, layer in experts.items()]
    spec = arch_spec(config)
    if spec.imatrix_inputs is not None:  # the family's inputs of tensors no linear takes (one vector per matrix)
        handles += spec.imatrix_inputs(model, text_hparams(config),
                                       lambda name, rows: add_expert_rows(expert_sums, name, list(rows)))
    device = device if device is not None else next(model.parameters()).device
    # only the decoder blocks' inputs are collected: run the decoder without the output head
    # (skips a (seq, vocab) logits tensor and the lm_head matmul per window)
    body = decoder(model) if callable(getattr(model, "get_decoder", None)) else None
    body = body if body is not None else model
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                body(input_ids=windows[start:start + batch_size].to(device))
    finally:
        for h in handles:
            h.remove()
    result = Imatrix(
        sums={n: s.cpu().numpy().astype(np.float32)[None, :] for n, s in sums.items() if s is not None},
        counts={n: np.array([c], dtype=np.float32) for n, c in counts.items() if c},
        datasets=[dataset], chunk_count=len(windows), chunk_size=int(windows.shape[1]) if len(windows) else 0,
    )
    for name, (s, c) in expert_sums.items():
        result.sums[name] = np.stack([v.cpu().numpy() for v in s]).astype(np.float32)
        result.counts[name] = np.asarray(c, dtype=np.float32)
    for first, others in split_pieces(config, targets).items():
        for name in others if first in result.sums else ():
            result.sums[name], result.counts[name] = result.sums[first].copy(), result.counts[first].copy()
    return result


def add_expert_rows(expert_sums: dict, name: str, rows: list) -> None:
    """Accumulate per-expert sums of squares and row counts."""
    import torch

    s, c = expert_sums.setdefault(name, ([torch.zeros(r.shape[-1], dtype=torch.float64) for r in rows],
                                         [0] * len(rows)))
    for e, r in enumerate(rows):
        s[e] += (r * r).sum(0)
        c[e] += r.shape[0]


# ------------------------------------------------------------------ files


def write(imatrix: Imatrix, path: Path) -> Path:
    """llama.cpp's GGUF imatrix format (what llama-imatrix writes by default)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", list(imatrix.datasets) or ["unknown"])
    writer.add_uint32("imatrix.chunk_count", imatrix.chunk_count)
    writer.add_uint32("imatrix.chunk_size", imatrix.chunk_size)
    for name in sorted(imatrix.sums):
        writer.add_tensor(name + SUM_SUFFIX, np.ascontiguousarray(imatrix.sums[name], dtype=np.float32))
        writer.add_tensor(name + COUNT_SUFFIX, np.asarray(imatrix.counts[name], dtype=np.float32).reshape(-1, 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def read(path: Path) -> Imatrix:
    """A GGUF imatrix, or a legacy .dat one."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"imatrix file not found: {path}",
                         hint="give the path of an imatrix .gguf (llama-imatrix) or .dat, or --imatrix auto to "
                              "compute one")
    with open(path, "rb") as f:
        magic = f.read(4)
    return read_gguf(path) if magic == b"GGUF" else read_legacy(path)


def read_gguf(path: Path) -> Imatrix:
    from quantkit.gguf.loader import open_reader

    reader = open_reader(path)
    out = Imatrix(datasets=field_value(reader, "imatrix.datasets") or [],
                  chunk_count=field_value(reader, "imatrix.chunk_count") or 0,
                  chunk_size=field_value(reader, "imatrix.chunk_size") or 0)
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    for tname, data in tensors.items():
        if tname.endswith(SUM_SUFFIX):
            name = tname[: -len(SUM_SUFFIX)]
            if name + COUNT_SUFFIX not in tensors:
                raise InputError(f"{path}: {name} has sums but no counts",
                                 hint="the imatrix file is damaged: compute it again, or use --imatrix auto")
            out.sums[name] = data.reshape(-1, data.shape[-1])
            out.counts[name] = tensors[name + COUNT_SUFFIX].reshape(-1)
    if not out.sums:
        raise InputError(f"{path}: no imatrix entries (*.in_sum2 tensors)",
                         hint="the file is not an imatrix: give llama-imatrix's output, or use --imatrix auto")
    return out


def field_value(reader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def read_legacy(path: Path) -> Imatrix:
    """The .dat format: values are (sum/count)*ncall with counts {ncall}; weights = values/ncall."""
    data = path.read_bytes()
    try:
        (n_entries,), pos = struct.unpack_from("<i", data, 0), 4
        out = Imatrix(legacy=True)
        for _ in range(n_entries):
            (length,) = struct.unpack_from("<i", data, pos)
            name = data[pos + 4: pos + 4 + length].decode()
            ncall, nval = struct.unpack_from("<ii", data, pos + 4 + length)
            pos += 12 + length
            values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).copy()
            pos += 4 * nval
            out.sums[name], out.counts[name] = values[None, :], np.array([ncall], dtype=np.float32)
        out.chunk_count = struct.unpack_from("<i", data, pos)[0] if pos + 4 <= len(data) else 0
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is neither a GGUF imatrix nor a legacy .dat imatrix",
                         hint="give llama-imatrix's output (.gguf or .dat), or use --imatrix auto") from exc
    return out


def check_fits(imatrix: Imatrix, info, gguf_type: str, path: Path) -> None:
    """InputError naming the file when the imatrix was made for another model: an entry for a
    tensor this model lacks, or a row size that differs (what llama-quantize would reject)."""
    from quantkit.gguf.convert import imatrix_size, plan_tensors

    rows = {p.name: imatrix_size(p.shape) for p in plan_tensors(info.config, info.tensors, gguf_type, has_imatrix=True)}
    unknown = sorted(n for n in imatrix.sums if n not in rows)
    if unknown:
        raise InputError(f"imatrix {path} has entries for {len(unknown)} tensor(s) this model lacks "
                         f"(e.g. {unknown[0]}): it was computed for another model",
                         hint="compute one for this model, or use --imatrix auto")
    for name, sums in sorted(imatrix.sums.items()):
        if name != "token_embd.weight" and sums.size != rows[name]:
            raise InputError(f"imatrix {path}: {name} has {sums.size} columns, this model's tensor takes "
                             f"{rows[name]} (columns x matrices): it was computed for another model",
                             hint="compute one for this model, or use --imatrix auto")
