"""Measuring an artifact against its base: token windows (windows), the metrics and the gate
(evaluate), streamed forwards a decoder layer at a time (stream), a scorer per artifact kind
(scorers, artifacts, compressed), the VLM tower proof (vlm_proof) and llama.cpp's cross-check
(llamacpp)."""
