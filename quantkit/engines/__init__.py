"""Everything that touches third-party engine internals: loading with transformers
(transformers), llm-compressor and compressed-tensors (llmcompressor/), and the one inventory of
run-time patches of third-party code, each with the versions it was verified against (patches)."""
