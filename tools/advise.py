"""Memory advisor: which strategy fits a ViT on your GPUs, before you launch anything.

    python tools/advise.py --model google/vit-huge-patch14-224-in21k --gpus 4 --batch 32
    python tools/advise.py --model ./my-checkpoint --gpus 8 --nodes 2 --batch 64 --gpu-memory 141

For every multi-process strategy of the table (vit_recipes/plan/strategies.py) it prints, per GPU, parameters,
gradients, optimizer states and activations (without / with gradient checkpointing), whether that fits
`--gpu-memory`, the host memory offloading needs per node (vit_recipes/plan/memory.py), and the config file to launch
with. It reads only the model's config (no weights).

The figures come from vit_recipes/plan/memory.py. A run reads the same estimate at start: gradient
checkpointing left unset turns on only where the batch does not fit without it, and a sharded strategy where a
faster one fits says so in one line.

Model states (P parameters, N GPUs, L parameters of the largest layer, bf16/fp16 training with AdamW):

- DDP: accelerate's `estimate_training_usage` (fp32 weights 4P, gradients 4P + 2P for the 16-bit GEMM copies,
  Adam moments 8P); FSDP2 shards all of it over N and adds two unsharded layers in flight (2 x 2L);
- ZeRO-1/2/3 and ZeRO++ (the shipped configs: DeepSpeed's torch_autocast, fp32 weights): fp32 parameters (4P, or
  4P/N + two gathered layers 8L under ZeRO-3; ZeRO++ adds hpZ's secondary copy, 4P / GPUs per node), fp32 gradients
  (4P under ZeRO-1, else 4P/N), optimizer (fp32 master 4P/N + Adam moments 8P/N);
- ZeRO-2/3 with offload (DeepSpeed's bf16 mode): DeepSpeed's `estimate_zero2_model_states_mem_needs` /
  `estimate_zero3_model_states_mem_needs` (16-bit parameters on the GPU, the rest in host memory);
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

from vit_recipes.core.errors import RecipeError
from vit_recipes.model.facts import load_config
from vit_recipes.plan.memory import GIB, PREFERENCE, Estimate, ModelShape, estimate, gib, model_shape


def fits(e: Estimate, gpu_bytes: float) -> str:
    """ "yes", "with ckpt" (fits only with gradient checkpointing) or "no"."""
    if e.total <= gpu_bytes:
        return "yes"
    if e.total_ckpt <= gpu_bytes:
        return "with ckpt"
    return "no"


def recommend(estimates: list[Estimate], gpu_bytes: float) -> tuple[Estimate, bool] | None:
    """The first strategy in PREFERENCE that fits, preferring no checkpointing (it costs ~30% more compute)."""
    by_key = {e.strategy.name: e for e in estimates}
    for ckpt in (False, True):
        for key in PREFERENCE:
            e = by_key.get(key)
            if e is not None and (e.total_ckpt if ckpt else e.total) <= gpu_bytes:
                return e, ckpt
    return None


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
        f"Memory per GPU in GiB (totals include {gib(estimates[0].overhead)} GiB overhead):",
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
                gib(e.params),
                gib(e.grads),
                gib(e.optimizer),
                gib(e.activations),
                gib(e.activations_ckpt),
                gib(e.total),
                gib(e.total_ckpt),
                fits(e, gpu_bytes),
                gib(e.host_per_node) if e.host_per_node else "-",
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
