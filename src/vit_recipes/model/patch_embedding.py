"""The patch-embedding Conv2d as one matmul (faster on GPUs); its parameters and state-dict keys stay the same."""

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class PatchMatmulConv2d(nn.Conv2d):
    """A Conv2d with kernel == stride, no padding, dilation or groups, computed as a matmul over patches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        ph, pw = self.kernel_size
        rows, cols = height // ph, width // pw
        x = x[..., : rows * ph, : cols * pw]  # a convolution drops the incomplete edge patches too
        patches = x.reshape(batch, channels, rows, ph, cols, pw).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(batch, rows * cols, channels * ph * pw)  # (c, ph, pw) order: the filter's layout
        out = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        # The convolution's (B, D, rows, cols) layout, as a view: ViT's flatten(2).transpose(1, 2) undoes it free.
        return out.transpose(1, 2).reshape(batch, self.out_channels, rows, cols)


def is_patch_conv(m: nn.Module) -> bool:
    plain = type(m) is nn.Conv2d and (m.padding, m.dilation, m.groups, m.padding_mode) == ((0, 0), (1, 1), 1, "zeros")
    return plain and m.kernel_size == m.stride


def use_patch_matmul(model: nn.Module, enabled: bool = True) -> int:
    """Compute every patch-embedding convolution of `model` as a matmul, in place; returns how many."""
    convs = [m for m in model.modules() if is_patch_conv(m)] if enabled else []
    for conv in convs:  # swapping the class keeps the parameters (and DeepSpeed/FSDP attributes on them) untouched
        conv.__class__ = PatchMatmulConv2d
    if convs:
        logger.info("Patch embedding computed as a matmul (%d convolution(s); --patch_embedding_matmul)", len(convs))
    return len(convs)
