"""A new format and the method that writes it (docs/development.md): "toy-int8", a checkpoint directory whose
config.json says `"quantization_config": {"quant_method": "toy-int8"}` and whose safetensors hold each quantized
Linear weight as int8 values (`NAME.weight_q`) and one float32 scale per row (`NAME.weight_scale`).

FORMAT tells quantkit how to recognize it, how the gate reads it (a Reading: each weight dequantized when the
streamed forward reaches it, computed in float32), its preflight bytes, and that no engine serves it. METHOD
writes it (per-row symmetric int8 of the decoder Linear weights). Registered as `toy-int8 =
tests.plugins.toy_int8:FORMAT` under quantkit.formats and `toy-int8 = tests.plugins.toy_int8:METHOD` under
quantkit.methods.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from quantkit.formats import Format, Runtime
from quantkit.methods import MethodSpec, QuantizeJob, QuantizeResult, Sizes, fixed_gate

KIND = "toy-int8"
VALUES, SCALES = ".weight_q", ".weight_scale"  # suffixes of a quantized weight's two tensors


# ------------------------------------------------------------------ the format


def plain_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return {key: value for key, value in config.items() if key != "quantization_config"}


def detect(path: Path) -> bool:
    from quantkit.io.checkpoint import quant_method

    config = path / "config.json"
    return path.is_dir() and config.is_file() and quant_method(json.loads(config.read_text())) == KIND


class Int8Weights:
    """The artifact's weights by Hugging Face name, each dequantized when read (quantkit.eval.stream.WeightSource)."""

    def __init__(self, path: Path):
        from quantkit.io.checkpoint import SafetensorsWeights

        self.stored = SafetensorsWeights(path)

    def keys(self) -> list[str]:
        return [name.removesuffix("_q") for name in self.stored.keys() if not name.endswith(SCALES)]

    def get(self, name: str):
        if name + "_q" not in self.stored.index:
            return self.stored.get(name).float()
        return self.stored.get(name + "_q").float() * self.stored.get(name.removesuffix(".weight") + SCALES)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stored.shape(name + "_q" if name + "_q" in self.stored.index else name)

    def rows(self, name: str, index):
        return self.get(name)[index]


def hf_config(path: Path):
    from transformers import AutoConfig

    config = plain_config(path)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def reading(path: Path, base_dir: Path | None, trust_remote_code: bool):
    import torch

    from quantkit.eval.stream import Reading, build_meta_model

    config = hf_config(path)
    return Reading(config, lambda: (build_meta_model(config, torch.float32), Int8Weights(path)))


def load(path: Path, base_dir: Path | None, device: str, trust_remote_code: bool):
    """The whole model in float32 (what `reading` streams), every parameter from the artifact."""
    model, weights = reading(path, base_dir, trust_remote_code).open()
    model.load_state_dict({name: weights.get(name) for name in weights.keys()}, strict=False, assign=True)
    missing = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if missing:
        raise ValueError(f"{path}: no tensor for {missing[:3]}")
    return model.to(device).eval()


def streams(config: dict, keeps_lm_head: bool, trust_remote_code: bool) -> bool:
    return True


FORMAT = Format(
    kind=KIND, detect=detect, reading=reading, load=load, library="transformers", engines=(),
    runtimes=lambda scheme: (Runtime("toy: dequantized to float32 by quantkit", ("cpu",), 0.0, "tests/plugins"),),
    serve_command=lambda path: f"python -c 'print(\"no engine serves {path}\")'", gate_dtype="float32",
    streams=streams,
)


# ------------------------------------------------------------------ the method that writes it


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    return "int8 per row (toy-int8)" if role == "decoder" else None


def quantize(job: QuantizeJob) -> QuantizeResult:
    import torch
    from safetensors.torch import save_file

    from quantkit.io.checkpoint import SafetensorsWeights
    from tests.plugins.toy_round import quantized

    stored, chosen, tensors = SafetensorsWeights(job.info.path), quantized(job), {}
    for name in stored.keys():
        weight = stored.get(name)
        if name not in chosen:
            tensors[name] = weight
            continue
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        tensors[name + "_q"] = torch.round(weight.float() / scale).clamp(-127, 127).to(torch.int8)
        tensors[name.removesuffix(".weight") + SCALES] = scale
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(Path(job.out_dir) / "model.safetensors"),
              metadata={"format": "pt"})
    config = {**json.loads((Path(job.info.path) / "config.json").read_text()),
              "quantization_config": {"quant_method": KIND, "bits": 8}}
    (Path(job.out_dir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return QuantizeResult(Path(job.out_dir), {"quantized": len(chosen)})


METHOD = MethodSpec(
    name="toy-int8", format=FORMAT, label="toy-int8 checkpoint (int8 values, a float32 scale per row)",
    scheme=lambda options: "int8", engine="toy-int8", engine_package="quantkit", options=Options, quantize=quantize,
    precision=precision, default_gate=fixed_gate({"max_kld": 0.05}), needs_model=lambda info, options: False,
    sizes=Sizes(stored_bits=lambda options: 8.0),
)
