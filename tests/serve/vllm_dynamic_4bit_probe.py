"""Run by vLLM's own interpreter (tests/serve/test_w4a8_vllm_slow.py): how the CPU kernel of vLLM's W4A8-int scheme
(Dynamic4bitLinearKernel: torch's _dyn_quant_pack_4bit_weight / _dyn_quant_matmul_4bit) quantizes activations. Packs
random int4 weights as that kernel does, multiplies inputs with uneven channels, and prints one JSON line: the
largest difference from float activations and from int8 per-token symmetric and asymmetric references."""

import json

import torch


def dequantized(weight, scale, group: int):
    out, width = weight.shape
    return (weight.float().reshape(out, -1, group) * scale.float().unsqueeze(-1)).reshape(out, width)


def symmetric(x):
    s = x.abs().amax(-1, keepdim=True) / 127
    return (x / s).round().clamp(-128, 127) * s


def asymmetric(x):
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    s = (high - low) / 255
    zero = (-128 - low / s).round()
    return ((x / s + zero).round().clamp(-128, 127) - zero) * s


def main() -> dict:
    torch.manual_seed(0)
    out, width, group = 64, 256, 128
    weight = torch.randint(-8, 8, (out, width), dtype=torch.int8)
    scale = (torch.rand(out, width // group) * 0.01 + 0.001).to(torch.bfloat16)
    x = torch.randn(4, width) * torch.linspace(0.1, 10, width)
    shifted = weight.add(8)  # Dynamic4bitLinearKernel.process_weights_after_loading
    packed = (shifted[:, 1::2] << 4 | shifted[:, ::2]).to(torch.uint8)
    kernel = torch.ops.aten._dyn_quant_pack_4bit_weight(packed, scale, None, group, width, out)
    y = torch.ops.aten._dyn_quant_matmul_4bit(x, kernel, group, width, out)
    w = dequantized(weight, scale, group).t()
    return {name: (y - ref @ w).abs().max().item()
            for name, ref in (("float", x), ("symmetric", symmetric(x)), ("asymmetric", asymmetric(x)))}


if __name__ == "__main__":
    print(json.dumps(main()))
