"""quantkit.toy.sharpen: the copy computes the model's function with its logits scaled, for norms that scale by
w (Llama) and by 1 + w (Gemma 3)."""

from __future__ import annotations

import pytest

from quantkit.toy import sharpen, shifted_norms
from tests.gguf.families import build_family


def logits(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["llama32", "gemma3"])
def test_sharpen_scales_the_logits_and_keeps_the_function(family, tmp_path):
    import torch

    base = build_family(family, tmp_path / "base")
    sharp = sharpen(base, tmp_path / "sharp", logit_scale=4.0)
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(logits(sharp, ids), 4.0 * logits(base, ids), rtol=1e-3, atol=1e-3)


def test_only_gemma_norms_are_shifted():
    assert shifted_norms({"architectures": ["Gemma3ForCausalLM"]})
    assert not shifted_norms({"architectures": ["LlamaForCausalLM"]})
    assert not shifted_norms({"architectures": ["SomethingNew"]})
