"""Per-layer int4 / int8 / 16-bit for the compressed-tensors int methods (gptq `auto_precision`).

Sensitivity: for every Linear the method quantizes, the round-to-nearest error of its weight at
int4 (the target's group size and symmetry) and at int8 (per output channel, same symmetry),
weighted per input column by its importance (mean x_j^2 of that input column over the calibration
windows, collected by quantkit.gguf.imatrix.compute with the layer-streamed forward):

    error(layer, p) = sum_ij importance_j * (w_ij - rtn_p(w)_ij)^2        (16-bit: 0)

The rounding is compressed-tensors' own (calculate_qparams + fake_quantize of the scheme's
QuantizationArgs). With measure_windows > 0, each layer's error curve is scaled into KL divergence
units by the KLD measured with only that layer at int4 (quantkit.mixed.scaled_damage).

Size model: the bytes a compressed-tensors pack-quantized checkpoint stores for one Linear of
shape (out, in), E = bytes per element of the checkpoint's dtype (2 for bf16/fp16):

    int4 (group g):  weight_packed  out * ceil(in/8) * 4          (8 values per int32)
                     weight_scale   out * (in/g) * E
                     zero point     ceil(out/8) * (in/g) * 4      (asymmetric only; packed along out)
                     weight_shape   16                            (2 x int64)
    int8 (channel):  weight_packed  out * ceil(in/4) * 4,  weight_scale out * E,
                     zero point     ceil(out/4) * 4 (asymmetric only),  weight_shape 16
    16-bit:          weight         out * in * E

Budget: the W4A16 bytes of the budgeted layers x (1 + headroom), or budget_bpw bits per weight of
them. quantkit.mixed.assign raises layers from int4 to int8 (or 16-bit) by the largest damage removed
per added byte. Quantization: one config group int4 targeting "Linear", one int8 targeting the
chosen modules by exact name (compressed-tensors matches exact names before class names), the
16-bit layers in the ignore list.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantkit.errors import InputError
from quantkit.mixed import scaled_damage

PRECISIONS = ("int4", "int8", "16-bit")  # cheapest first
PROBE = "int4"  # the precision each layer's KL divergence is measured at
BITS = {"int4": 4, "int8": 8}
SHAPE_BYTES = 16  # weight_shape: two int64


class AutoPrecision(BaseModel):
    """Per-layer int4 / int8 / 16-bit chosen by measured sensitivity under a size budget."""

    model_config = ConfigDict(extra="forbid")
    budget_bpw: float | None = Field(None, gt=0, le=16, description="bits per weight of the quantized "
                                     "layers (scales and zero points included); default: W4A16 x (1 + headroom)")
    headroom: float = Field(0.05, ge=0, le=4, description="budget above the all-int4 (W4A16) size of the "
                            "quantized layers, as a fraction (0.05: +5%)")
    measure_windows: int = Field(8, ge=0, le=1024, description="calibration windows the per-layer KL "
                                 "divergence is measured on (0: importance-weighted error only)")


@dataclass
class LayerSensitivity:
    name: str  # module name
    shape: tuple[int, int]  # (out_features, in_features)
    errors: dict[str, float]  # precision -> importance-weighted squared error
    kld: float | None = None  # measured KL divergence with only this layer at `probe`
    probe: str = PROBE

    @property
    def candidates(self) -> list[str]:
        return list(self.errors)

    def damage(self, precision: str) -> float:
        return scaled_damage(self.kld, self.errors[precision], self.errors[self.probe])

    @classmethod
    def from_dict(cls, row: dict) -> "LayerSensitivity":
        return cls(row["tensor"], tuple(row["shape"]), dict(row["errors"]), row["kld"], row["probe"])

    def as_dict(self) -> dict:
        """A row of the report's table (`mixture`: the precision plain W4A16 gives the layer)."""
        return {"tensor": self.name, "shape": list(self.shape), "mixture": PROBE, "probe": self.probe,
                "kld": self.kld, "errors": self.errors, "damage": {p: self.damage(p) for p in self.candidates}}


@dataclass
class LayerTable:
    layers: list[LayerSensitivity]
    measured: bool  # damage scaled by measured KL divergence (else: the weighted error alone)
    windows: int = 0  # calibration windows the KL divergences were measured on
    seconds: dict[str, float] = field(default_factory=dict)  # "importance", "errors", "kld"

    @classmethod
    def from_dict(cls, data: dict) -> "LayerTable":
        """The table as the report recorded it (as_dict)."""
        return cls([LayerSensitivity.from_dict(r) for r in data["tensors"]], data["measured"], data["windows"],
                   dict(data.get("seconds", {})))

    def as_dict(self) -> dict:
        return {"measured": self.measured, "windows": self.windows, "seconds": self.seconds,
                "candidates": list(PRECISIONS), "tensors": [r.as_dict() for r in self.layers]}


@dataclass
class TiedLayers:
    """Layers that take one precision together (a quantkit.mixed Row): their damages and bytes add.
    `highest`: the highest candidate they may take (None: every candidate of the first member)."""

    name: str
    members: list[LayerSensitivity]
    highest: str | None = None

    @property
    def candidates(self) -> list[str]:
        cands = self.members[0].candidates
        return cands if self.highest is None else cands[:cands.index(self.highest) + 1]

    def damage(self, precision: str) -> float:
        return sum(m.damage(precision) for m in self.members)


# ------------------------------------------------------------------ scheme and size model


@dataclass(frozen=True)
class Scheme:
    """The target's int4 scheme (int8 is per channel with the same symmetry) and the checkpoint's
    bytes per element (scales and 16-bit layers are stored in its dtype)."""

    group_size: int  # -1: per channel
    symmetric: bool
    element_bytes: int = 2

    def weights(self, precision: str) -> dict:
        """compressed-tensors weight QuantizationArgs fields of an int precision."""
        from quantkit.methods.gptq import weight_args

        return weight_args(BITS[precision], -1 if precision == "int8" else self.group_size, self.symmetric)

    def args(self, precision: str):
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(**self.weights(precision))

    def nbytes(self, shape: tuple[int, int], precision: str) -> int:
        return layer_bytes(shape, precision, self.group_size, self.symmetric, self.element_bytes)

    def size(self, row: "LayerSensitivity", precision: str) -> int:
        """quantkit.mixed's size model."""
        return self.nbytes(row.shape, precision)


def packed_bytes(count: int, bits: int) -> int:
    """int32 words holding `count` values of `bits` bits, in bytes."""
    return math.ceil(count * bits / 32) * 4


def layer_bytes(shape: tuple[int, int], precision: str, group_size: int, symmetric: bool, element_bytes: int) -> int:
    """Bytes stored for one Linear weight at `precision` (the size model above; group_size -1: per channel)."""
    out, inp = shape
    if precision == "16-bit":
        return out * inp * element_bytes
    bits = BITS[precision]
    groups = 1 if precision == "int8" or group_size == -1 else inp // group_size
    zero_points = 0 if symmetric else packed_bytes(out, bits) * groups
    return out * packed_bytes(inp, bits) + out * groups * element_bytes + zero_points + SHAPE_BYTES


def budget_bytes(auto: AutoPrecision, shapes: list[tuple[int, int]], scheme: Scheme) -> tuple[int, int]:
    """(bytes the budgeted layers may take, their all-int4 bytes); InputError when budget_bpw is below all-int4."""
    int4 = sum(scheme.nbytes(shape, "int4") for shape in shapes)
    if auto.budget_bpw is None:
        return int(int4 * (1 + auto.headroom)), int4
    weights = sum(o * i for o, i in shapes)
    allowed = int(auto.budget_bpw * weights / 8)
    if allowed < int4:
        raise InputError(f"auto_precision: budget_bpw={auto.budget_bpw} is below the all-int4 size of the "
                         f"quantized layers ({8 * int4 / weights:.3f} bits per weight)",
                         hint="raise budget_bpw, or leave it out (W4A16 size + headroom)")
    return allowed, int4


# ------------------------------------------------------------------ weighted errors


def rtn(weight, args):
    """Round-to-nearest of a float32 (out, in) weight in `args`'s scheme, dequantized (compressed-tensors' own)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.group_size:
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    else:
        lo, hi = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    scale, zero_point = calculate_qparams(lo, hi, args)
    return fake_quantize(weight, scale, zero_point, args)


def weighted_error(weight, importance, args) -> float:
    """sum_ij importance_j * (w - rtn(w))_ij^2 in float64."""
    diff = (weight - rtn(weight, args)).double()
    return float((diff * diff * importance.double()).sum())


def layer_errors(weight, importance, scheme: Scheme) -> dict[str, float]:
    errors = {p: weighted_error(weight, importance, scheme.args(p)) for p in BITS}
    return {**errors, "16-bit": 0.0}


def read_weight(source, name: str):
    """A layer's weight from the checkpoint, float32."""
    from quantkit.errors import UnsupportedError

    key = name + ".weight"
    if key not in source.index:
        raise UnsupportedError(f"auto_precision: {key} is not a tensor of the checkpoint (its modules are "
                               "renamed while loading)", hint="quantize without --auto-precision")
    return source.get(key).float()


def error_table(model_dir: Path, shapes: dict[str, tuple[int, int]], importance: dict,
                scheme: Scheme) -> list[LayerSensitivity]:
    """Weighted errors of every layer ({module name: (out, in)}); importance: {module name: vector},
    uniform for a layer the calibration windows never reached."""
    import torch

    from quantkit.stream import SafetensorsWeights

    source = SafetensorsWeights(model_dir)
    table = []
    for name, shape in shapes.items():
        weight = read_weight(source, name)
        imp = importance.get(name)
        imp = torch.ones(shape[1]) if imp is None else torch.as_tensor(imp, dtype=torch.float32)
        table.append(LayerSensitivity(name, tuple(shape), layer_errors(weight, imp, scheme)))
    return table


def probe_patches(model_dir: Path, table: list[LayerSensitivity], scheme: Scheme):
    """(layer, {its weight name: its weight at the probe precision}) one layer at a time."""
    from quantkit.stream import SafetensorsWeights

    source = SafetensorsWeights(model_dir)
    for row in table:
        weight = read_weight(source, row.name)
        yield row.name, {row.name + ".weight": rtn(weight, scheme.args(row.probe))}


def measure(model_dir: Path, shapes: dict[str, tuple[int, int]], importance: dict, calib_windows, auto: AutoPrecision,
            scheme: Scheme, workdir: Path | None = None) -> LayerTable:
    """The sensitivity table: weighted errors, and with measure_windows > 0 the single-layer KLDs."""
    from quantkit.mixed import single_tensor_klds

    started = time.perf_counter()
    table = error_table(model_dir, shapes, importance, scheme)
    seconds = {"errors": round(time.perf_counter() - started, 3)}
    if auto.measure_windows == 0:
        return LayerTable(table, False, 0, seconds)
    windows = calib_windows[:auto.measure_windows]
    started = time.perf_counter()
    klds = single_tensor_klds(model_dir, probe_patches(model_dir, table, scheme), windows,
                              "auto_precision.measure_windows: 0", workdir)
    for row in table:
        row.kld = klds[row.name]
    seconds["kld"] = round(time.perf_counter() - started, 3)
    return LayerTable(table, True, len(windows), seconds)


# ------------------------------------------------------------------ plan, config groups, report


def config_groups(choice: dict[str, str], scheme: Scheme) -> dict:
    """compressed-tensors config groups: int4 for every Linear, int8 for the chosen layers by exact name."""
    groups = {"group_0": {"targets": ["Linear"], "weights": scheme.weights("int4")}}
    int8 = sorted(name for name, p in choice.items() if p == "int8")
    if int8:
        groups["group_1"] = {"targets": int8, "weights": scheme.weights("int8")}
    return groups


def kept_16bit(choice: dict[str, str]) -> list[str]:
    """The layers the plan keeps in 16 bits (added to the ignore list)."""
    return sorted(name for name, p in choice.items() if p == "16-bit")


def plan_report(table: list[LayerSensitivity], choice: dict[str, str], allowed: int, int4: int, scheme: Scheme) -> dict:
    """details.mixed_precision: the budget, the bytes, every layer's precision and the counts."""
    from quantkit.mixed import total_bytes

    counts = {p: sum(1 for c in choice.values() if c == p) for p in PRECISIONS}
    return {"budget_bytes": allowed, "w4a16_bytes": int4, "bytes": total_bytes(table, choice, scheme.size),
            "counts": counts, "types": dict(sorted(choice.items())),
            "changed": {name: f"int4->{p}" for name, p in sorted(choice.items()) if p != "int4"}}
