"""Kernel-level timings behind the one-GPU speed levers (benchmarks/run.py measures whole runs; this measures parts).

    python benchmarks/kernels.py --out benchmarks/results/h200_kernels

On one GPU, bf16 autocast, forward + backward, CUDA-event timings after warm-up:
- patch embedding: the convolution vs `--patch_embedding_matmul` (ViT-B/16 batch 512, ViT-H/14 batch 64);
- attention: each SDPA backend at ViT-B/16's and ViT-H/14's shapes;
- augmentation: the sampling grid of the random-resized crop (torch's affine_grid vs ours) and the whole train
  transform, eager and compiled, on a batch of 512 CIFAR-sized uint8 images;
- one ViT-B/16 encoder layer at batch 512: eager, compiled (what --torch_compile_regions runs), compiled with
  torchao FP8 (--fp8), and timm's Block compiled; the compiled layer's kernels grouped into matmuls, attention and
  the rest, which bounds the whole model's speed (12 layers).
Writes kernels.json (figures, command, commit, device, versions), kernels.md with kernels.png, and
layer_kernels.txt (the profiler's table). Needs a CUDA GPU; `--replot` redraws kernels.md and kernels.png from
kernels.json anywhere.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from run import device_description, git_commit, gpu_info, library_versions  # noqa: E402

from vit_recipes.patch_embedding import use_patch_matmul  # noqa: E402
from vit_recipes.transforms import TrainTransform, affine_grid  # noqa: E402

VIT_B_LAYER_TFLOP = 3 * 2 * 197 * (4 * 768 * 768 + 2 * 768 * 3072) * 512 / 1e12  # matmuls, fwd + bwd, batch 512


def timed(fn, iters: int = 20, warmup: int = 5) -> float:
    """Milliseconds per call, by CUDA events around `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters, 3)


def train_step(module, *inputs):
    """Forward under bf16 autocast and backward, as the Trainer runs a layer."""

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            out = module(*inputs)
            out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    return step


def patch_embedding() -> dict:
    results = {}
    for name, batch, dim, patch in (("vit-b16-b512", 512, 768, 16), ("vit-h14-b64", 64, 1280, 14)):
        conv = torch.nn.Conv2d(3, dim, patch, stride=patch).cuda()
        pixels = torch.randn(batch, 3, 224, 224, device="cuda")
        results[f"{name} convolution ms"] = timed(train_step(conv, pixels))
        use_patch_matmul(conv)
        results[f"{name} matmul ms"] = timed(train_step(conv, pixels))
    return results


def attention() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = {}
    for name, shape in (("vit-b16-b512", (512, 12, 197, 64)), ("vit-h14-b64", (64, 16, 257, 80))):
        qkv = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

            def step(backend=backend, qkv=qkv):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(*qkv).sum().backward()

            try:
                results[f"{name} {backend.name.lower()} ms"] = timed(step)
            except RuntimeError as err:  # a backend that does not take this shape
                results[f"{name} {backend.name.lower()} ms"] = f"unsupported: {str(err).splitlines()[0][:80]}"
    return results


def augmentation() -> dict:
    theta = torch.randn(512, 2, 3, device="cuda")
    transform = TrainTransform(224, 0.5, 0.5).cuda()
    pixels = torch.randint(0, 256, (512, 3, 32, 32), dtype=torch.uint8, device="cuda")
    results = {
        "grid torch affine_grid ms": timed(lambda: F.affine_grid(theta, [512, 3, 224, 224], align_corners=False)),
        "grid broadcast ms": timed(lambda: affine_grid(theta, 224)),
        "train transform eager ms": timed(lambda: transform(pixels)),
    }
    start = time.perf_counter()
    compiled = torch.compile(transform)
    compiled(pixels)
    results["train transform compile s"] = round(time.perf_counter() - start, 1)
    results["train transform compiled ms"] = timed(lambda: compiled(pixels))
    return results


def kernel_groups(profile) -> dict:
    """Self GPU time of the profiled kernels, in groups: matmuls, attention, everything else."""
    groups = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in profile.key_averages():
        name = event.key.lower()
        if any(k in name for k in ("sdpa", "fmha", "flash", "attention", "cudnn::fusion")):
            group = "attention"
        elif any(k in name for k in ("nvjet", "gemm", "cutlass", "splitkreduce")):
            group = "matmul"
        else:
            group = "other"
        groups[group] += event.self_device_time_total / 1000
    return groups


def layer(out: Path) -> dict:
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTLayer

    config = ViTConfig()
    config._attn_implementation = "sdpa"  # as the script loads it (attn_implementation="sdpa")
    hidden = torch.randn(512, 197, 768, device="cuda", requires_grad=True)
    results = {"ViT-B/16 layer eager ms": timed(train_step(ViTLayer(config).cuda(), hidden))}
    compiled = torch.compile(ViTLayer(config).cuda())
    step = train_step(compiled, hidden)
    results["ViT-B/16 layer compiled ms"] = timed(step)
    iters = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    table = profile.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
    (out / "layer_kernels.txt").write_text(
        f"One compiled ViTLayer, batch 512, bf16, fwd + bwd, {iters} calls\n{table}\n"
    )
    for group, ms in kernel_groups(profile).items():
        results[f"compiled layer {group} ms"] = round(ms / iters, 3)
    matmul_ms = results["compiled layer matmul ms"]
    results["compiled layer matmul TFLOP/s"] = round(VIT_B_LAYER_TFLOP / (matmul_ms / 1000), 1)
    try:
        from torchao.float8 import convert_to_float8_training

        fp8_layer = ViTLayer(config).cuda()
        convert_to_float8_training(fp8_layer)
        results["ViT-B/16 layer compiled fp8 ms"] = timed(train_step(torch.compile(fp8_layer), hidden))
    except ImportError:
        results["ViT-B/16 layer compiled fp8 ms"] = "torchao not installed"
    try:
        from timm.models.vision_transformer import Block

        block = torch.compile(Block(768, 12, mlp_ratio=4.0, qkv_bias=True).cuda())
        results["timm Block compiled ms"] = timed(train_step(block, hidden))
    except ImportError:
        results["timm Block compiled ms"] = "timm not installed"
    return results


TARGET_IMAGES_PER_SECOND = 5_000  # the speed issue's one-GPU ViT-B/16 target
LAYERS = 12  # ViT-B/16


def chart(record: dict, path: Path) -> None:
    """One compiled layer's time by kernel group next to the other variants, and 12 layers against the step the
    5,000 img/s target allows at batch 512."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer = record["sections"]["One encoder layer"]
    parts = [(group, layer[f"compiled layer {group} ms"]) for group in ("matmul", "attention", "other")]
    colours = {"matmul": "tab:blue", "attention": "tab:orange", "other": "tab:grey"}
    others = [
        (name, layer.get(key))
        for name, key in (
            ("eager", "ViT-B/16 layer eager ms"),
            ("compiled + FP8", "ViT-B/16 layer compiled fp8 ms"),
            ("timm Block, compiled", "timm Block compiled ms"),
        )
        if isinstance(layer.get(key), float)
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.8, 3.8), gridspec_kw={"width_ratios": [1, 1]})
    labels = ["compiled"] + [name for name, _ in others]
    start = 0.0
    for group, ms in parts:
        left.barh(0, ms, left=start, color=colours[group], label=group)
        start += ms
    for i, (_, ms) in enumerate(others, start=1):
        left.barh(i, ms, color="tab:purple", alpha=0.6)
        left.text(ms, i, f" {ms:.1f}", va="center")
    left.text(start, 0, f" {layer['ViT-B/16 layer compiled ms']:.1f} (kernels {start:.1f})", va="center")
    left.set_xlim(0, max([start] + [ms for _, ms in others]) * 1.45)
    left.set_yticks(range(len(labels)), labels)
    left.invert_yaxis()
    left.set_xlabel("ms per layer, forward + backward")
    left.set_title("One ViT-B/16 layer, batch 512, bf16")
    left.legend(loc="center right", fontsize=8)
    start = 0.0
    for group, ms in parts:
        right.barh(0, ms * LAYERS, left=start, color=colours[group], label=group)
        start += ms * LAYERS
    target_ms = 512 / TARGET_IMAGES_PER_SECOND * 1000
    right.axvline(target_ms, color="tab:red", linestyle="--")
    target = f"whole step at {TARGET_IMAGES_PER_SECOND:,} img/s: {target_ms:.0f} ms "
    right.text(target_ms, 0.5, target, ha="right", color="tab:red")
    right.text(start, 0, f" {start:.0f} ms of kernels", va="center")
    right.set_xlim(0, start * 1.35)
    right.set_yticks([0], [f"{LAYERS} compiled layers"])
    right.set_ylim(-0.6, 0.8)
    right.set_xlabel("ms per batch of 512")
    right.set_title("The encoder alone vs the one-GPU target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(record: dict) -> str:
    lines = [
        f"# Kernel timings ({record['device']})",
        "",
        f"`{record['command']}` at commit {record['git_commit']}; bf16 autocast, forward + backward, "
        "milliseconds per call.",
        "",
    ]
    for section, figures in record["sections"].items():
        lines += [f"## {section}", "", "| what | value |", "|---|---|"]
        lines += [f"| {name} | {value:,} |" if isinstance(value, float) else f"| {name} | {value} |"
                  for name, value in figures.items()]  # fmt: skip
        lines.append("")
    lines += ["![kernels](kernels.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for kernels.json, kernels.md, layer_kernels.txt")
    parser.add_argument("--replot", action="store_true", help="rewrite kernels.md and kernels.png from kernels.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        record = json.loads((out / "kernels.json").read_text())
        write_report(record, out)
        return
    if not torch.cuda.is_available():
        sys.exit("error: benchmarks/kernels.py times GPU kernels and needs a CUDA GPU")
    out.mkdir(parents=True, exist_ok=True)
    sections = {}
    for title, fn in (
        ("Patch embedding", patch_embedding),
        ("Attention (SDPA backends)", attention),
        ("Augmentation", augmentation),
        ("One encoder layer", lambda: layer(out)),
    ):
        sections[title] = fn()
        print(json.dumps({title: sections[title]}, indent=1), flush=True)
    record = {
        "command": shlex.join(["python", "benchmarks/kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        "git_commit": git_commit(),
        "device": device_description(gpu_info()),
        "versions": library_versions(),
        "sections": sections,
    }
    (out / "kernels.json").write_text(json.dumps(record, indent=1) + "\n")
    write_report(record, out)


def write_report(record: dict, out: Path) -> None:
    chart(record, out / "kernels.png")
    (out / "kernels.md").write_text(markdown(record))
    print(f"wrote {out}/kernels.md and kernels.png")


if __name__ == "__main__":
    main()
