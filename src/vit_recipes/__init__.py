"""Recipes to fine-tune Vision Transformers with transformers, DeepSpeed and FSDP."""

__version__ = "0.1.0"
