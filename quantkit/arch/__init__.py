"""What quantkit knows about model architectures, as data: the role of a weight by its name
(roles), the smoothing mappings AWQ and SmoothQuant balance (mappings), the expert layouts of
mixture-of-experts models (moe), the towers of vision-language models (vlm), and the families
docs/models.md's support tables name (families). Imports nothing above quantkit.errors."""
