"""FP8 matmuls for training (`--fp8`) over fp32/bf16 weights: torchao's float8 linear layers, or TE's per ViT layer."""

import logging

import torch
import torch.nn.functional as F
from transformers.models.vit.modeling_vit import ViTLayer

from ..core.errors import RecipeError

logger = logging.getLogger(__name__)


def _convertible(module: torch.nn.Module, name: str) -> bool:
    if not isinstance(module, torch.nn.Linear) or module.in_features % 16 or module.out_features % 16:
        return False
    parts = name.split(".")
    return "classifier" not in parts and not any(p.startswith("lora_") for p in parts)


def convert_to_fp8(model: torch.nn.Module, training_args) -> int:
    """Run the model's eligible layers in FP8 with --fp8_backend, in place; returns how many were converted."""
    if not getattr(training_args, "fp8", False):
        return 0
    if training_args.fp8_backend == "transformer_engine":
        return convert_to_transformer_engine(model)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = not torch.cuda.is_available() or getattr(training_args, "use_cpu", False)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate), module_filter_fn=_convertible)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not converted:
        raise RecipeError("--fp8 found no linear layer it could convert (sizes must be multiples of 16): drop --fp8")
    cpu = "; emulated on the CPU (no speed-up)" if emulate else ""
    logger.info(f"--fp8: {converted} linear layers run their matmuls in FP8 (torchao float8, tensorwise scales){cpu}")
    return converted


def convert_to_transformer_engine(model: torch.nn.Module) -> int:
    """Make every ViT layer of `model` a TransformerEngineViTLayer, in place; returns how many."""
    # Imported before any CUDA op: TE loads its own cuDNN, which clashes with the one torch loads on first use.
    import transformer_engine.pytorch  # noqa: F401

    layers = [m for m in model.modules() if type(m) is ViTLayer]
    if not layers:
        raise RecipeError("--fp8_backend transformer_engine converts ViT layers, and this model has none: use torchao")
    for layer in layers:
        a, mlp = layer.attention, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.fc1, mlp.fc2)
        if any(type(m) is not torch.nn.Linear for m in linears):  # e.g. peft's LoRA layers
            raise RecipeError("--fp8_backend transformer_engine does not combine with LoRA: use --fp8_backend torchao")
        if any(m.in_features % 16 or m.out_features % 16 for m in linears):
            raise RecipeError("--fp8 needs layer sizes that are multiples of 16: drop --fp8")
        layer.__class__ = TransformerEngineViTLayer  # same parameters and state-dict keys, another forward
    logger.info("--fp8: %d ViT layers train through Transformer Engine's FP8 kernels", len(layers))
    return len(layers)


# Hand-written: accelerate's convert_model and te.TransformerLayer both change a ViT's parameters and state dict.
class TransformerEngineViTLayer(ViTLayer):
    """Trains via TE's FP8 matmuls on its own parameters (not copied; TE's scaling history unsaved); eval: eager."""

    warned = False  # about a batch FP8 cannot take, once per process

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        batch, tokens, width = hidden_states.shape
        fp8_shape = (batch * tokens) % 16 == 0  # e.g. not an odd last batch, nor some --patch_dropout token counts
        if self.training and not fp8_shape and not TransformerEngineViTLayer.warned:
            TransformerEngineViTLayer.warned = True
            logger.warning("--fp8: %d x %d tokens is not a multiple of 16: such steps run without FP8", batch, tokens)
        if not (self.training and fp8_shape) or attention_mask is not None:
            return super().forward(hidden_states, attention_mask, **kwargs)
        te, qkv, out, fc1, fc2 = self._transformer_engine(hidden_states.device)
        a = self.attention
        with te.autocast(enabled=True):  # TE's default recipe for this GPU: delayed scaling on Hopper
            q, k, v = qkv(hidden_states).view(batch, tokens, 3, a.num_attention_heads, -1).transpose(1, 3).unbind(2)
            context = F.scaled_dot_product_attention(q, k, v, dropout_p=a.attention_dropout, scale=a.scaling)
            hidden_states = hidden_states + self.dropout(out(context.transpose(1, 2).reshape(batch, tokens, width)))
            mlp = fc2(self.mlp.activation_fn(fc1(hidden_states)))  # exact GELU (TE's fused MLP has the tanh form)
        return hidden_states + self.dropout(mlp)

    def _transformer_engine(self, device: torch.device) -> tuple:
        """TE, LayerNorm+QKV, attention output, LayerNorm+fc1 and fc2 on the layer's parameters (outside the state dict)."""
        a, mlp = self.attention, self.mlp
        if "_te" not in self.__dict__:
            import transformer_engine.pytorch as te

            width, hidden, split = mlp.fc1.in_features, mlp.fc1.out_features, ("query", "key", "value")
            qkv = te.LayerNormLinear(width, 3 * width, eps=self.layernorm_before.eps, bias=a.q_proj.bias is not None,
                                     parameters_split=split, device=device)  # fmt: skip
            fc1 = te.LayerNormLinear(width, hidden, eps=self.layernorm_after.eps, device=device)
            out, fc2 = te.Linear(width, width, device=device), te.Linear(hidden, width, device=device)
            self.__dict__["_te"] = (te, qkv, out, fc1, fc2)
        te, qkv, out, fc1, fc2 = self.__dict__["_te"]
        for module, norm, linears in (
            (qkv, self.layernorm_before, {"query_": a.q_proj, "key_": a.k_proj, "value_": a.v_proj}),
            (out, None, {"": a.o_proj}),
            (fc1, self.layernorm_after, {"": mlp.fc1}),
            (fc2, None, {"": mlp.fc2}),
        ):
            params = {f"{name}{kind}": getattr(m, kind) for name, m in linears.items() for kind in ("weight", "bias")}
            if norm is not None:
                params.update(layer_norm_weight=norm.weight, layer_norm_bias=norm.bias)
            module._parameters.update({name: p for name, p in params.items() if p is not None})
        return te, qkv, out, fc1, fc2
