"""A method on an existing format (docs/development.md): each decoder Linear weight rounded to `bits` per output
row (symmetric round-to-nearest, one scale per row) and stored back in the checkpoint's own dtype, so the artifact
is a plain transformers checkpoint (quantkit.formats.transformers): the gate reads it, vLLM serves it.

It reads the checkpoint a tensor at a time (needs_model False: no model is loaded) and writes one safetensors
file. Registered as `toy-round = tests.plugins.toy_round:METHOD` under the entry-point group quantkit.methods.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantkit.formats import transformers
from quantkit.methods import MethodSpec, QuantizeJob, QuantizeResult, fixed_gate


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bits: int = Field(8, ge=2, le=8, description="the grid each row is rounded to")


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    return f"int{options.bits} per row, stored 16-bit (toy-round)" if role == "decoder" else None


def rounded(weight, bits: int):
    """`weight` on a symmetric grid of 2**(bits-1)-1 steps per row, in its own dtype."""
    import torch

    values = weight.float()
    top = 2 ** (bits - 1) - 1
    scale = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top
    return (torch.round(values / scale).clamp(-top, top) * scale).to(weight.dtype)


def quantized(job: QuantizeJob) -> set[str]:
    """The weights the plan quantizes: decoder Linear weights the ignore list leaves."""
    from quantkit.arch.roles import classify, linear_weights, matches

    return {f"{name}.weight" for name in linear_weights(job.info)
            if classify(f"{name}.weight", job.info.towers) == "decoder" and not matches(name, job.ignore)}


def quantize(job: QuantizeJob) -> QuantizeResult:
    from safetensors.torch import save_file

    from quantkit.io.checkpoint import SafetensorsWeights

    stored, chosen = SafetensorsWeights(job.info.path), quantized(job)
    tensors = {name: (rounded(stored.get(name), job.options.bits) if name in chosen else stored.get(name))
               for name in stored.keys()}
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(Path(job.out_dir) / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((Path(job.info.path) / "config.json").read_text())
    (Path(job.out_dir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return QuantizeResult(Path(job.out_dir), {"rounded": len(chosen)})


METHOD = MethodSpec(
    name="toy-round", format=transformers.FORMAT, label="transformers checkpoint (toy-round: rounded, stored 16-bit)",
    scheme=lambda options: "16-bit", engine="toy-round", engine_package="quantkit", options=Options,
    quantize=quantize, precision=precision, default_gate=fixed_gate({"max_kld": 0.05}),
    needs_model=lambda info, options: False,
)
