"""One quantize run, above the methods: the recipe and its validation (recipe), checks before work
(preflight), calibration text (calibration), LoRA merging (lora), the precision plan (plan), the
pipeline that runs each target, gates it and writes it atomically (pipeline), the report and model
card (report), --skip-existing's fingerprints (cache) and README's support tables (support)."""
