"""Files and memory: the checkpoint as read before loading (checkpoint), the one safetensors reader
(safetensors), row files and shards (rowio, shards), atomic export of an output directory (export),
offline mode (offline), non-finite checks (numerics) and the process heap (memory)."""
