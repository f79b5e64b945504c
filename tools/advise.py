"""Memory advisor: which strategy fits a ViT on your GPUs, before you launch anything.

    python tools/advise.py --model google/vit-huge-patch14-224-in21k --gpus 4 --batch 32
    python tools/advise.py --model ./my-checkpoint --gpus 8 --nodes 2 --batch 64 --gpu-memory 141

For every multi-process strategy of the table (vit_recipes/strategies.py) it prints, per GPU, parameters,
gradients, optimizer states and activations (without / with gradient checkpointing), whether that fits
`--gpu-memory`, the host memory offloading needs per node (vit_recipes/memory.py), and the config file to launch
with. It reads only the model's config (no weights).

Model states (P parameters, N GPUs, L parameters of the largest layer, 16-bit training with AdamW):

- DDP: accelerate's `estimate_training_usage` (fp32 weights 4P, gradients 4P + 2P for the 16-bit GEMM copies,
  Adam moments 8P); FSDP2 shards all of it over N and adds two unsharded layers in flight (2 x 2L);
- ZeRO-2/3 and their offload variants: DeepSpeed's `estimate_zero2_model_states_mem_needs` /
  `estimate_zero3_model_states_mem_needs` totals, split the way DeepSpeed counts them: 16-bit parameters (2P, or
  2P/N + 4L under ZeRO-3), gradients (16-bit 2P/N + fp32 4P/N under ZeRO-2; fp32 4P/N under ZeRO-3), optimizer
  (fp32 master 4P/N + Adam moments 8P/N). ZeRO-1 is ZeRO-2 with unpartitioned 16-bit gradients (2P instead of
  2P/N). ZeRO++ adds hpZ's secondary 16-bit copy (2P / GPUs per node).
- fp32 training: parameters 4, gradients 4, Adam 8 bytes per parameter, partitioned the same way.

Activations (per GPU, per-device batch b, s tokens, hidden h, MLP width i, a heads, e bytes per element): each
layer keeps s*b*(8h + 2i)*e (LayerNorm inputs/outputs, Q/K/V, attention output, MLP input, GELU input/output)
plus, for the attention, the softmax logsumexp 4*b*a*s (fused SDPA) or the probabilities b*a*s^2*e (eager).
Checkpointing keeps only each layer's input s*b*h*e and recomputes one layer at a time. Patch-embedding input,
final LayerNorm and logits are added once. An allowance (--overhead, default 2 GiB: CUDA context, allocator slack,
communication buckets) is added to every total.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from vit_recipes import memory
from vit_recipes.errors import RecipeError
from vit_recipes.memory import BUFFER, GIB, fsdp2_offload_host, load_config
from vit_recipes.strategies import STRATEGIES, StrategySpec

OPTIONS = tuple(s for s in STRATEGIES if s.name != "single")  # the multi-process rows


@dataclass
class Estimate:
    strategy: StrategySpec
    params: float  # bytes per GPU
    grads: float
    optimizer: float
    activations: float  # without checkpointing
    activations_ckpt: float  # with gradient checkpointing
    host_per_node: float  # bytes of host memory per node for offloaded states
    overhead: float

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.overhead

    @property
    def total_ckpt(self) -> float:
        return self.states + self.activations_ckpt + self.overhead

    def fits(self, gpu_bytes: float) -> str:
        if self.total <= gpu_bytes:
            return "yes"
        if self.total_ckpt <= gpu_bytes:
            return "with ckpt"
        return "no"


# --------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelShape:
    params: int
    largest_layer_params: int
    layers: int
    hidden: int
    heads: int
    intermediate: int
    image_size: int
    patch_size: int
    num_labels: int
    channels: int = 3

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # patches + [CLS]


def model_shape(config, num_labels: int | None = None, image_size: int | None = None) -> ModelShape:
    """Sizes of the classification model (built on the meta device: no memory) and the config's dimensions."""
    config = config.__class__.from_dict(config.to_dict())  # a copy we may change
    if num_labels:
        config.num_labels = num_labels
    if image_size:
        config.image_size = image_size
    params, largest = memory.model_size(config)
    size = config.image_size[0] if isinstance(config.image_size, (list, tuple)) else config.image_size
    patch = config.patch_size[0] if isinstance(config.patch_size, (list, tuple)) else config.patch_size
    return ModelShape(
        params=params,
        largest_layer_params=largest,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        image_size=int(size),
        patch_size=int(patch),
        num_labels=config.num_labels,
        channels=getattr(config, "num_channels", 3),
    )


def activation_bytes(
    shape: ModelShape, batch: int, precision: str = "bf16", checkpointing: bool = False, attention: str = "sdpa"
) -> float:
    """Activations kept for the backward pass on one GPU, in bytes (see the module docstring)."""
    e = 4 if precision == "fp32" else 2
    b, s, h, i, a = batch, shape.tokens, shape.hidden, shape.intermediate, shape.heads
    attention_term = 4 * b * a * s if attention == "sdpa" else b * a * s * s * e
    per_layer = s * b * (8 * h + 2 * i) * e + attention_term
    once = b * shape.channels * shape.image_size**2 * e + s * b * h * e + b * (h + 2 * shape.num_labels) * 4
    if checkpointing:
        return shape.layers * s * b * h * e + per_layer + once
    return shape.layers * per_layer + once


# -------------------------------------------------------------------------------------------- model states


def zero2_states(params: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """DeepSpeed's ZeRO-2 estimator, or its formula (deepspeed 0.19) where DeepSpeed is not installed."""
    try:
        return memory.zero2_states(params, gpus_per_node, nodes, offload)
    except ImportError:
        n = gpus_per_node * nodes
        if offload:
            return int(params * max(4 * n, 16) * 1.5), 2 * params
        return int(params * 4 * gpus_per_node * 1.5), 2 * params + int(18 * params / n)


def zero3_states(params: int, largest: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int, int]:
    """DeepSpeed's ZeRO-3 estimator, or its formula (deepspeed 0.19, zero_init=True) where it is not installed."""
    try:
        return memory.zero3_states(params, largest, gpus_per_node, nodes, offload)
    except ImportError:
        n, layer = gpus_per_node * nodes, 4 * largest
        if offload:
            return int(params * 18 / nodes * 1.5), layer, layer
        return int(largest * 4 * gpus_per_node * 1.5), layer + int(18 * params / n), layer


def _accelerate_ddp(params: int, precision: str) -> dict[str, int]:
    from accelerate.commands.estimate import estimate_training_usage

    dtype = "float32" if precision == "fp32" else "bfloat16"
    return estimate_training_usage(4 * params, dtype)


def model_states(key: str, shape: ModelShape, gpus_per_node: int, nodes: int, precision: str = "bf16"):
    """(params, grads, optimizer) bytes per GPU and host bytes per node for one strategy."""
    P, L = shape.params, shape.largest_layer_params
    n = gpus_per_node * nodes
    ddp = _accelerate_ddp(P, precision)
    if key == "ddp":
        return ddp["model"], ddp["gradients"], ddp["optimizer"], 0.0
    if key.startswith("fsdp"):
        in_flight = 2 * L * (4 if precision == "fp32" else 2)  # two unsharded layers in the compute dtype
        if key == "fsdp2":
            return ddp["model"] / n + in_flight, ddp["gradients"] / n, ddp["optimizer"] / n, 0.0
        return in_flight, in_flight / 2, 0.0, fsdp2_offload_host(P, nodes)
    if precision == "fp32":  # DeepSpeed's estimators assume 16-bit training; the same partitioning in fp32
        return _zero_fp32(key, P, L, n, gpus_per_node, nodes)
    # DeepSpeed's totals, split the way it counts them: 16-bit params, 16-bit + fp32 gradients, fp32 master + Adam
    optimizer = 12 * P / n
    if key in ("zero1", "zero2"):
        _, gpu = zero2_states(P, gpus_per_node, nodes, offload=False)
        params = 2 * P
        grads = gpu - params - optimizer  # 2P/N 16-bit + 4P/N fp32
        if key == "zero1":
            grads += 2 * P - 2 * P / n  # ZeRO-1 keeps the full 16-bit gradients
        return params, grads, optimizer, 0.0
    if key == "zero2_offload":
        host, gpu = zero2_states(P, gpus_per_node, nodes, offload=True)
        return float(gpu), 0.0, 0.0, float(host)
    if key in ("zero3", "zeropp"):
        _, gpu, largest = zero3_states(P, L, gpus_per_node, nodes, offload=False)
        params = 2 * P / n + largest  # own partition + the gathered layers in flight
        grads = gpu - params - optimizer  # 4P/N fp32
        if key == "zeropp":
            params += 2 * P / gpus_per_node  # hpZ: a secondary 16-bit partition within the node
        return params, grads, optimizer, 0.0
    if key == "zero3_offload":
        host, gpu, _ = zero3_states(P, L, gpus_per_node, nodes, offload=True)
        return float(gpu), 0.0, 0.0, float(host)
    raise KeyError(key)


def _zero_fp32(key, P, L, n, gpus_per_node, nodes):
    if key == "zero1":
        return 4 * P, 4 * P, 8 * P / n, 0.0
    if key == "zero2":
        return 4 * P, 4 * P / n, 8 * P / n, 0.0
    if key == "zero2_offload":
        return 4 * P, 0.0, 0.0, (4 + 8) * P / nodes * BUFFER
    if key in ("zero3", "zeropp"):
        extra = 4 * P / gpus_per_node if key == "zeropp" else 0
        return 4 * P / n + 8 * L + extra, 4 * P / n, 8 * P / n, 0.0
    if key == "zero3_offload":
        return 8 * L, 0.0, 0.0, (4 + 4 + 8) * P / nodes * BUFFER
    raise KeyError(key)


def estimate(
    shape: ModelShape,
    gpus: int,
    batch: int,
    nodes: int = 1,
    precision: str = "bf16",
    attention: str = "sdpa",
    overhead_gib: float = 2.0,
    keys: tuple[str, ...] | None = None,
) -> list[Estimate]:
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise RecipeError(f"--gpus {gpus} must be a positive multiple of --nodes {nodes}")
    per_node = gpus // nodes
    act = activation_bytes(shape, batch, precision, False, attention)
    act_ckpt = activation_bytes(shape, batch, precision, True, attention)
    out = []
    for spec in OPTIONS:
        if keys and spec.name not in keys:
            continue
        params, grads, optimizer, host = model_states(spec.name, shape, per_node, nodes, precision)
        out.append(Estimate(spec, params, grads, optimizer, act, act_ckpt, host, overhead_gib * GIB))
    return out


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def render(
    name: str,
    shape: ModelShape,
    estimates: list[Estimate],
    gpus: int,
    nodes: int,
    batch: int,
    precision: str,
    gpu_memory_gib: float,
) -> str:
    gpu_bytes = gpu_memory_gib * GIB
    lines = [
        f"{name}: {shape.params / 1e6:.1f}M parameters (largest layer {shape.largest_layer_params / 1e6:.1f}M), "
        f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, {shape.tokens} tokens at "
        f"{shape.image_size}px, {shape.num_labels} labels",
        f"{gpus} GPU(s) on {nodes} node(s), per-device batch {batch}, {precision}, {gpu_memory_gib:g} GiB per GPU. "
        f"Memory per GPU in GiB (totals include {_gib(estimates[0].overhead)} GiB overhead):",
        "",
    ]
    header = (
        "strategy",
        "params",
        "grads",
        "optim",
        "act",
        "act ckpt",
        "total",
        "total ckpt",
        "fits",
        "host/node",
        "config",
    )
    rows = [header]
    for e in estimates:
        rows.append(
            (
                e.strategy.label,
                _gib(e.params),
                _gib(e.grads),
                _gib(e.optimizer),
                _gib(e.activations),
                _gib(e.activations_ckpt),
                _gib(e.total),
                _gib(e.total_ckpt),
                e.fits(gpu_bytes),
                _gib(e.host_per_node) if e.host_per_node else "-",
                e.strategy.accelerate_config,
            )
        )
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(header))]
    for r in rows:
        cells = (str(v).ljust(w) if c in (0, 8, 10) else str(v).rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
        lines.append("  ".join(cells).rstrip())
    pick = recommend(estimates, gpu_bytes)
    lines.append("")
    if pick is None:
        lines.append(
            f"Nothing fits {gpu_memory_gib:g} GiB at batch {batch}: lower --batch (and raise "
            "--gradient_accumulation_steps to keep the global batch), or add GPUs."
        )
    else:
        e, ckpt = pick
        extra = " --gradient_checkpointing true" if ckpt else ""
        lines.append(
            f"Suggested: {e.strategy.label}{' with gradient checkpointing' if ckpt else ''}: accelerate launch "
            f"--config_file {e.strategy.accelerate_config} --num_processes {gpus} run_image_classification.py "
            f"--per_device_train_batch_size {batch}{extra} ..."
        )
        if e.strategy.deepspeed_config:
            lines.append(
                f"   or: deepspeed --num_gpus {gpus // nodes} run_image_classification.py --deepspeed "
                f"{e.strategy.deepspeed_config} --per_device_train_batch_size {batch}{extra} ..."
            )
    return "\n".join(lines)


# Simplest/fastest first: communication grows down the list, offload trades GPU memory for host bandwidth.
PREFERENCE = ("ddp", "zero1", "zero2", "fsdp2", "zero3", "zeropp", "zero2_offload", "fsdp2_offload", "zero3_offload")


def recommend(estimates: list[Estimate], gpu_bytes: float) -> tuple[Estimate, bool] | None:
    """The first strategy in PREFERENCE that fits, preferring no checkpointing (it costs ~30% more compute)."""
    by_key = {e.strategy.name: e for e in estimates}
    for ckpt in (False, True):
        for key in PREFERENCE:
            e = by_key.get(key)
            if e is not None and (e.total_ckpt if ckpt else e.total) <= gpu_bytes:
                return e, ckpt
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/advise.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="Hub id (cached, or online) or local folder with config.json")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs in total (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="Machines the GPUs are spread over (default 1)")
    parser.add_argument("--batch", type=int, default=32, help="Per-device (micro) batch size (default 32)")
    parser.add_argument("--gpu-memory", type=float, default=80, help="GiB per GPU (default 80)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--num-labels", type=int, default=None, help="Classes of the new head (default: config's)")
    parser.add_argument("--image-size", type=int, default=None, help="Input resolution (default: config's)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--overhead", type=float, default=2.0, help="GiB added per GPU (context, buffers)")
    args = parser.parse_args(argv)
    try:
        if args.batch < 1:
            raise RecipeError(f"--batch must be >= 1, got {args.batch}")
        config = load_config(args.model)
        shape = model_shape(config, args.num_labels, args.image_size)
        estimates = estimate(shape, args.gpus, args.batch, args.nodes, args.precision, args.attention, args.overhead)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render(args.model, shape, estimates, args.gpus, args.nodes, args.batch, args.precision, args.gpu_memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
