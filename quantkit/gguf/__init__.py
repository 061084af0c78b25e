"""GGUF, owned by quantkit: conversion from a Hugging Face checkpoint (convert, vocab,
special_vocab, mmproj), the quant kernels bit-exact to ggml (quants, kquants_numpy,
kquants_numba; the grid i-quants: iquants_grid_numba, iquants_grid, iquant_tables), llama-quantize's per-tensor mixture (mixture), the importance matrix (imatrix),
reading a .gguf back (loader) and the Ollama Modelfile (modelfile)."""
