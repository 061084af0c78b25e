"""Granite 4 hybrid (GraniteMoeHybridForCausalLM) on a tiny random checkpoint: a Mamba-2 layer and an attention
layer, the shared MLP, Granite's multipliers, no RoPE (as granite-4.0-h checkpoints); every method, each artifact
proven in its consumer. Its MoE variant is refused before work by every method.

Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter and
llama-quantize, MLX against mlx-lm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families import common

FAMILY = "granitemoehybrid"
# as IBM's checkpoints store them (transformers 5 reads both; llama.cpp's converter, reading config.json
# itself, only these)
LAYER_TYPES = ["mamba", "attention"]
SIZES = dict(shared_intermediate_size=512, num_local_experts=0, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64,
             mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=64, embedding_multiplier=12.0,
             residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
             position_embedding_type="nope", tie_word_embeddings=True)


def build(out: Path, layer_types: list[str] = LAYER_TYPES, **config) -> Path:
    """Granite 4 hybrid as its checkpoints are: config.json's layer_types "mamba" / "attention"."""
    common.build(out, "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", layer_types=layer_types,
                 **{**SIZES, **config})
    stored = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**stored, "layer_types": layer_types}, indent=2))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


COMPRESSED = {"fp8": [], "gptq": [], "awq": [], "autoround": ["--iters", "2"], "smoothquant": [], "nvfp4": [],
              "mxfp4": [], "nf4": []}
FAST = ("fp8", "gptq")


@pytest.mark.parametrize("method", [pytest.param(m, marks=() if m in FAST else pytest.mark.slow) for m in COMPRESSED])
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, method, *COMPRESSED[method]), out)
    common.assert_strict_reload(out)
    if method != "nf4":
        kept = common.kept_16bit(out)
        # the Mamba projections are quantized (every consumer takes them quantized)
        assert not any("mamba" in k for k in kept), kept


def test_gguf(cli, model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
