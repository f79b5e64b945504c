#!/usr/bin/env python
"""What torch.compile costs on a first and a second run, and what each way of compiling saves per step, for the
ViT-B recipe's training step (bf16 autocast, AdamW, clipping, the GPU crop/flip) at a given batch.

Each (way, cache) pair is a fresh process: `cold` starts from an empty inductor cache folder, `warm` reuses the
folder the cold process filled, as the same command run again does. A process reports its first steps' time (the
compile), the steady ms per step, and torch's cache counters (inductor's FX graph cache, AOTAutograd's cache), so a
slow second run says which cache missed.

    python benchmarks/compile_probe.py --model bench_assets/vit-base --out <record> --ways eager,regions,whole
    python benchmarks/compile_probe.py --one regions --batch 128 ...   # one process (what the parent runs)

Ways: eager; regions (accelerate's regional compilation: each encoder layer compiled once, as our runs do); whole
(the whole model); whole-cudagraphs (the whole model in mode reduce-overhead: CUDA graphs). Writes OUT/compile_probe.json
and OUT/compile_probe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("eager", "regions", "whole", "whole-cudagraphs")


def one(args) -> dict:
    """Train `args.steps` steps one way in this process; return its timings and cache counters."""
    import torch
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForImageClassification

    sys.path.insert(0, str(ROOT / "src"))
    from vit_recipes.transforms import TrainTransform

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script
    config = AutoConfig.from_pretrained(args.model, num_labels=100)
    model = AutoModelForImageClassification.from_config(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
    augment = TrainTransform(config.image_size, 0.5, 0.5, crop_scale_min=0.25, hflip_prob=0.5).to(device)
    mode = "reduce-overhead" if args.way == "whole-cudagraphs" else None
    if args.way == "regions":
        model = compile_regions(model)
    elif args.way.startswith("whole"):
        model = torch.compile(model, mode=mode)
    images = torch.randint(0, 256, (args.batch, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 100, (args.batch,), device=device)

    def step():
        if mode:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(pixel_values=augment(images)).logits
            loss = torch.nn.functional.cross_entropy(logits.float(), labels, label_smoothing=0.1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    steady = (time.perf_counter() - start) / args.steps
    wanted = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    aot = ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass", "autograd_cache_saved")
    return {
        "way": args.way, "batch": args.batch, "first_steps": args.warmup, "first_steps_s": round(first, 2),
        "steady_ms": round(steady * 1e3, 2), "img_per_s": round(args.batch / steady), "loss": round(loss.item(), 4),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0, 2),
        "inductor": {k: counters["inductor"][k] for k in wanted if counters["inductor"][k]},
        "aot_autograd": {k: counters["aot_autograd"][k] for k in aot if counters["aot_autograd"][k]},
    }  # fmt: skip


def script(argv: list[str]) -> dict:
    """The real run, in this process: which of torch's caches its compile hit, and where its compile time went."""
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    from torch._dynamo.utils import compile_times, counters

    import run_image_classification

    results = run_image_classification.main(argv)
    return {
        "warmup_s": results.get("train_warmup_s"), "img_per_s": results.get("train_images_per_second"),
        "counters": {group: dict(counters[group]) for group in ("inductor", "aot_autograd", "stats", "frames")},
        "compile_times_s": dict(sorted(zip(*compile_times(repr="csv", aggregate=True)), key=lambda kv: -float(kv[1]))[:15]),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench_assets/vit-base", help="A local model folder (its config is used).")
    p.add_argument("--out", help="Record folder (parent mode).")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--batches", default="128,256")
    p.add_argument("--one", dest="way", choices=WAYS, help="Run one way in this process and print its JSON.")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="First steps timed together (the compile).")
    p.add_argument("--steps", type=int, default=60, help="Steady steps timed after them.")
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--script", nargs=argparse.REMAINDER, help="Run run_image_classification.py's main with these "
                   "arguments in this process, then print its compile times and cache counters.")  # fmt: skip
    args = p.parse_args()
    if args.script is not None:
        print("PROBE " + json.dumps(script(args.script)), flush=True)
        return
    if args.way:
        print("PROBE " + json.dumps(one(args)), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for way in args.ways.split(","):
            cache = tempfile.mkdtemp(prefix=f"probe-{way}-")
            for run in ("cold", "warm") if way != "eager" else ("eager",):
                env = {
                    **os.environ,
                    "TORCHINDUCTOR_CACHE_DIR": cache,
                    "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
                }
                cmd = [sys.executable, __file__, "--one", way, "--batch", str(batch), "--model", args.model,
                       "--warmup", str(args.warmup), "--steps", str(args.steps)]  # fmt: skip
                start = time.perf_counter()
                try:
                    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                    lines = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
                    row = (
                        json.loads(lines[-1][6:])
                        if lines
                        else {"way": way, "batch": batch, "error": done.stderr[-600:]}
                    )
                except subprocess.TimeoutExpired:
                    row = {"way": way, "batch": batch, "error": f"timed out after {args.timeout} s"}
                row.update(run=run, process_s=round(time.perf_counter() - start, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "compile_probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| way | batch | run | process s | first steps s | steady ms | img/s | peak GiB | caches |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        caches = ", ".join(f"{k} {v}" for k, v in {**r.get("inductor", {}), **r.get("aot_autograd", {})}.items())
        lines.append(
            f"| {r['way']} | {r['batch']} | {r['run']} | {r['process_s']} | {r.get('first_steps_s', '')} | "
            f"{r.get('steady_ms', '')} | {r.get('img_per_s', '')} | {r.get('peak_gib', '')} | "
            f"{caches or r.get('error', '')[-200:]} |"
        )
    (out / "compile_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
