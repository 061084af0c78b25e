"""Run by vLLM's own interpreter (tests/serve/test_w4a8_vllm_slow.py): which compressed-tensors scheme and linear
kernel vLLM picks on this machine for an artifact's config group `group_0`, and the parameters it creates for one
Linear of the artifact's shape; one JSON line on stdout ({"error": ...} where vLLM refuses)."""

import json
import sys

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig


def probe(artifact: str, layer_name: str, out_features: int, in_features: int, port: str) -> dict:
    with open(f"{artifact}/config.json") as fh:
        qconfig = json.load(fh)["quantization_config"]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        config = CompressedTensorsConfig.from_config(qconfig)
        parts = config.target_scheme_map["Linear"]
        try:
            scheme = config._get_scheme_from_parts(parts["weights"], parts["input_activations"],
                                                   parts.get("output_activations"), parts.get("format"),
                                                   layer_name=layer_name)
            layer = torch.nn.Module()
            scheme.create_weights(layer, out_features, in_features, [out_features], in_features, torch.bfloat16,
                                  weight_loader=lambda *args, **kwargs: None)
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal (any exception type) is the result
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"scheme": type(scheme).__name__, "kernel": type(scheme.kernel).__name__,
                "params": {name: [str(p.dtype).removeprefix("torch."), list(p.shape)]
                           for name, p in layer.named_parameters(remove_duplicate=False)}}


if __name__ == "__main__":
    artifact, layer_name, out_features, in_features, port = sys.argv[1:6]
    print(json.dumps(probe(artifact, layer_name, int(out_features), int(in_features), port)))
