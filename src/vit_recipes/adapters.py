"""`from vit_recipes.adapters import load_model`: the import README.md and docs/lora.md show users, and model cards
name, kept where it was before the package's folders (the code is vit_recipes.model.adapters)."""

from .model.adapters import load_model

__all__ = ["load_model"]
