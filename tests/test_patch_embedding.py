"""--patch_embedding_matmul: the patch-embedding convolution computed as one matmul gives the convolution's
outputs and gradients, leaves the checkpoint format alone, and is applied only to convolutions it is exact for."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import model_args
from torch import nn

from vit_recipes.model.patch_embedding import PatchMatmulConv2d, is_patch_conv, use_patch_matmul


@pytest.mark.parametrize("height,width", [(16, 16), (18, 23)])  # 18x23: edge pixels a convolution drops
def test_matmul_matches_the_convolution_forward_and_backward(height, width):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 24, kernel_size=(4, 5), stride=(4, 5))
    fast = copy.deepcopy(conv)
    assert use_patch_matmul(fast) == 1 and type(fast) is PatchMatmulConv2d
    x = torch.randn(2, 3, height, width, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    want, got = conv(x), fast(x2)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.weight.grad, conv.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fast.bias.grad, conv.bias.grad, atol=1e-4, rtol=1e-5)


def test_only_non_overlapping_unpadded_convolutions_are_swapped():
    assert is_patch_conv(nn.Conv2d(3, 8, 16, stride=16))
    assert not is_patch_conv(nn.Conv2d(3, 8, 3, stride=1))  # overlapping windows
    assert not is_patch_conv(nn.Conv2d(3, 8, 4, stride=4, padding=1))
    assert not is_patch_conv(nn.Conv2d(4, 8, 4, stride=4, groups=2))
    assert not is_patch_conv(nn.Conv2d(3, 8, 4, stride=4, padding_mode="reflect"))
    assert use_patch_matmul(nn.Sequential(nn.Conv2d(3, 8, 4, stride=4)), enabled=False) == 0


def test_the_vit_keeps_its_outputs_and_checkpoint_format(tiny_vit):
    from vit_recipes.model.modeling import build_model

    labels = [f"c{i}" for i in range(7)]
    fast, _ = build_model(model_args(model_name_or_path=str(tiny_vit), patch_embedding_matmul=True), labels)
    plain, _ = build_model(model_args(model_name_or_path=str(tiny_vit), patch_embedding_matmul=False), labels)
    assert type(fast.vit.embeddings.patch_embeddings.projection) is PatchMatmulConv2d
    assert type(plain.vit.embeddings.patch_embeddings.projection) is nn.Conv2d
    assert {k: v.shape for k, v in fast.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    pixels = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast.eval()(pixels).logits, plain.eval()(pixels).logits, atol=1e-5, rtol=1e-5)
