"""quantkit: quantize and convert Hugging Face LLMs and VLMs into deployable artifacts."""

__version__ = "0.1.0"
