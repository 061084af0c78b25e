"""Mixed precision shared by every method: which layers or tensors cost most when quantized
(sensitivity), the budgets, the knapsack and the fallback ladder (budget), the per-layer
simulations and size models of the checkpoint methods (layers), and GGUF's per-tensor candidates
and search (gguf)."""
