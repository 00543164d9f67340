"""megalm: Megatron-style training of Transformer language models, configured with Hydra."""

__version__ = "0.1.0"
