"""Probe (committed once for the record 2026-11-28_augment_kernels_2xH200, then deleted): host ms, GPU ms and kernel
launches of one train-transform call (128 x 256 px -> 224, TrivialAugment or crop only), the transforms before this
change (transforms_main.py beside this file: src/vit_recipes/transforms.py at 97737b1) against this tree's.

    PYTHONPATH=src CUDA_VISIBLE_DEVICES=1 python benchmarks/augment_kernels_probe.py
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import transforms_main as OLD  # noqa: E402
from vit_recipes import transforms as NEW  # noqa: E402

dev = torch.device("cuda")
big = torch.randn(8192, 8192, device=dev)


def busy():
    for _ in range(6):
        big @ big


def split(fn, n=15):
    fn()
    torch.cuda.synchronize()
    hosts, gpus = [], []
    for _ in range(n):
        busy()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - t) * 1e3)
        e.record()
        torch.cuda.synchronize()
        gpus.append(s.elapsed_time(e))
    hosts.sort()
    gpus.sort()
    return {"host_ms": round(hosts[n // 2], 3), "gpu_ms": round(gpus[n // 2], 3)}


def kernels(fn):
    from torch.profiler import profile, ProfilerActivity

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    return sum(1 for e in p.events() if e.name in names), sum(1 for e in p.events() if e.name.startswith("cudaMemcpy"))


x = torch.randint(0, 256, (128, 3, 256, 256), dtype=torch.uint8, device=dev)
out, steps = {}, iter(range(10**6))
for label, mod in (("main", OLD), ("new", NEW)):
    ta = mod.TrainTransform(224, [0.5] * 3, [0.5] * 3, crop_scale_min=0.25, auto_augment="trivialaugment").to(dev)
    crop = mod.TrainTransform(224, [0.5] * 3, [0.5] * 3, crop_scale_min=0.25).to(dev)
    for name, fn in {
        f"ta_{label}": lambda: ta(x, mod.Randomness.for_batch(42, 0, next(steps), 0, dev)),
        f"crop_{label}": lambda: crop(x, mod.Randomness.for_batch(42, 0, next(steps), 0, dev)),
    }.items():
        launches, copies = kernels(fn)
        out[name] = {**split(fn), "launches": launches, "memcpy": copies}
print(json.dumps(out))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "hostprobe.json"), "w"), indent=1)
