"""llm-compressor and compressed-tensors: oneshot runs and their arguments (llmc), GPTQ's
single-copy Hessian loop (lean_hessian), FP8 without loading the model (model_free), and torchrun
launches (distributed)."""
