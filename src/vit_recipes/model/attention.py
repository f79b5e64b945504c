"""`--attn_implementation sdpa_direct`: attention that calls `torch.nn.functional.scaled_dot_product_attention` on
the tensors the model hands it, and does nothing else.

Why it exists: transformers' own "sdpa" (integrations/sdpa_attention.py) serves every family, language models
first: on each call it works out causality, grouped key/value heads, a position bias, softcap, NPU and MPS quirks,
and (5.2x) views the output once more. An image encoder needs none of it: its attention is not causal, has as many
key/value heads as query heads, and has no mask (ViT, DeiT, DINOv2) or one additive mask (BEiT's relative position
bias, Swin's windows), which goes to SDPA as transformers' own passes it. Eager, each of those checks and views is
host time in every layer of every step (ViT-B's step at batch 128 waits on the host); compiled, each is a guard.
The kernel is the same call on the same tensors (SDPA picks cuDNN, flash or efficient from them), so logits match
transformers' "sdpa", and nothing saved changes: transformers does not write the attention implementation into
config.json, so a checkpoint trained with it loads in plain transformers with any attention.

It is registered through transformers' public `AttentionInterface` (importing this module is enough): every model
class that supports SDPA and looks its attention up there (ViT, DeiT, DINOv2, BEiT, Swin, ...) takes the name.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "sdpa_direct"


def sdpa_direct(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """(batch, heads, seq, dim) query/key/value -> ((batch, seq, heads, dim) output, None), the layout transformers'
    attention functions return. A causal module, grouped key/value heads or a separate position bias or softcap
    (language models) go to transformers' own SDPA function, which handles them."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal  # transformers' own default
    if causal or query.shape[1] != key.shape[1] or kwargs.get("position_bias") is not None or kwargs.get("softcap"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    # cuDNN, flash and efficient attention write their output in (batch, seq, heads, dim) memory order when the
    # query is a transposed (batch, seq, heads, dim) projection, as in every family here: .contiguous() then copies
    # nothing. Other kernels (the math one, CPUs) need the one copy the caller's reshape would make anyway.
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_direct)
