"""`--patch_dropout RATE` (timm's `patch_drop_rate`): training keeps [CLS] and a fixed count of random patch tokens."""

import logging

import torch
from torch import nn

from ..core.errors import RecipeError

logger = logging.getLogger(__name__)


def token_embeddings(model: nn.Module) -> tuple[nn.Module, int]:
    """The module whose output is [prefix tokens, patch tokens] + positions, and how many prefix tokens it has."""
    for module in model.modules():
        cls_token = getattr(module, "cls_token", None)
        if type(module).__name__.endswith("Embeddings") and isinstance(cls_token, nn.Parameter):
            return module, 1 + isinstance(getattr(module, "distillation_token", None), nn.Parameter)  # DeiT: 2
    timm = ' (timm ViTs drop patches themselves: "patch_drop_rate" in the model_args of its config.json)'
    raise RecipeError(
        f"--patch_dropout needs a ViT-style model (an embeddings module with a [CLS] token); "
        f"{type(model).__name__} has none: drop --patch_dropout{timm * hasattr(model, 'timm_model')}"
    )


def keep_patches(tokens: torch.Tensor, prefix: int, keep: int) -> torch.Tensor:
    """(B, prefix + N, D) -> (B, prefix + keep, D): the prefix tokens and `keep` random patch tokens per sample."""
    batch, length, dim = tokens.shape
    order = torch.rand(batch, length - prefix, device=tokens.device).argsort(dim=1)[:, :keep]
    kept = tokens[:, prefix:].gather(1, order.unsqueeze(-1).expand(-1, -1, dim))
    return torch.cat([tokens[:, :prefix], kept], dim=1)


def add_patch_dropout(model: nn.Module, rate: float, image_size: int | None = None) -> int:
    """Drop `rate` of the patch tokens of every training forward of `model` on `image_size` images (default: the
    config's; DINOv2 trains at its processor's, below its config's); returns the patches kept per image."""
    if rate <= 0:
        return 0
    embeddings, prefix = token_embeddings(model)
    sizes = [v[0] if isinstance(v, (list, tuple)) else v for v in (model.config.image_size, model.config.patch_size)]
    patches = ((image_size or sizes[0]) // sizes[1]) ** 2
    keep = max(1, round(patches * (1 - rate)))
    embeddings.register_forward_hook(lambda m, args, out: keep_patches(out, prefix, keep) if m.training else out)
    logger.warning(f"--patch_dropout {rate:g}: training images keep {keep} of {patches} patches; evaluation sees all")
    return keep
