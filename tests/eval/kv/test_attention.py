"""A KV type applied inside the transformers model's attention: per KV head, after RoPE, skipped layers
unchanged, TurboQuant's raw first prefill, the model's own attention restored after."""

import dataclasses

import pytest
import torch

from quantkit.eval import kv
from quantkit.eval.kv.attention import kv_cache


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def logits(model, kind=None, prefill=0):
    ids = torch.arange(48)[None] % 128
    with torch.no_grad(), kv_cache(model, kind, prefill):
        return model(ids).logits


def kind(**fields):
    ident = dict(engine="test", name="test", flag=(), key=lambda x: x, value=lambda x: x)
    return kv.KvType(**{**ident, **fields})


def test_identity_type_changes_nothing(model):
    assert torch.equal(logits(model, kind()), logits(model))
    assert model.config._attn_implementation == "sdpa"


def test_keys_per_kv_head_after_rope(model):
    seen = []

    def record(x):
        seen.append(x.shape)
        return x

    logits(model, kind(key=record))
    assert seen == [torch.Size([1, 2, 48, 32])] * 4  # batch, KV heads (before repeat_kv), positions, head_dim


def test_type_changes_logits_and_skipped_layers_do_not(model):
    zero = kind(value=torch.zeros_like)
    assert not torch.allclose(logits(model, zero), logits(model))
    assert torch.equal(logits(model, dataclasses.replace(zero, skip=(0, 1, 2, 3))), logits(model))


def test_raw_prefill_positions_read_raw_keys(model):
    zero = kind(value=torch.zeros_like, raw_prefill=True)
    out, base = logits(model, zero, prefill=16), logits(model)
    torch.testing.assert_close(out[:, :16], base[:, :16])
    assert not torch.allclose(out[:, 16:], base[:, 16:])


@pytest.mark.slow
def test_engine_type_damage_orders_by_bits(model):
    shape = kv.shape_of(model.config)
    base = logits(model).log_softmax(-1)

    def kld(spec):
        lp = logits(model, kv.parse_one(spec, shape)).log_softmax(-1)
        return (base.exp() * (base - lp)).sum(-1).mean().item()

    assert 0 < kld("mlx:8g32") < kld("mlx:4g32") < kld("mlx:2g32")
    assert 0 < kld("llama.cpp:q8_0") < kld("llama.cpp:q4_0")
