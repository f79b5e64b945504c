"""Probe (kept one commit for its record, 2026-11-28_augment_launches_2xH200): host time of the keyed randomness' pieces and of the train transform (GPU kept busy, so launches never wait).
Needs transforms_old.py beside it: `git show e718606:src/vit_recipes/transforms.py > benchmarks/transforms_old.py`."""
import hashlib, json, os, random, sys, time
import torch
sys.path.insert(0, os.path.dirname(__file__))
import transforms_old as OLD
from vit_recipes import transforms as NEW

dev = torch.device("cuda")
big = torch.randn(8192, 8192, device=dev)

def busy():  # ~100+ ms of GPU work queued: the host never waits on a full launch queue during the timed part
    for _ in range(6):
        big @ big

def host_us(fn, n=100):
    fn(); torch.cuda.synchronize()
    busy()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(dt, 1)

g = torch.Generator(dev)
out = {}
out["cuda_generator_new"] = host_us(lambda: torch.Generator(dev))
out["cuda_generator_new_seeded"] = host_us(lambda: torch.Generator(dev).manual_seed(12345))
out["cuda_manual_seed"] = host_us(lambda: g.manual_seed(12345))
out["cpu_generator_new_seeded"] = host_us(lambda: torch.Generator().manual_seed(12345))
out["python_random"] = host_us(lambda: random.Random(1234567890123))
out["blake2b"] = host_us(lambda: hashlib.blake2b(b"42/0/17/0", digest_size=8).digest())
out["rand_default"] = host_us(lambda: torch.rand(128, 23, device=dev))
out["rand_own_generator"] = host_us(lambda: torch.rand(128, 23, device=dev, generator=g))
out["rand_fresh_generator"] = host_us(lambda: torch.rand(128, 23, device=dev, generator=torch.Generator(dev).manual_seed(1)))
out["for_batch"] = host_us(lambda: NEW.Randomness.for_batch(42, 0, 17, 0, dev))
x = torch.randint(0, 256, (128, 3, 256, 256), dtype=torch.uint8, device=dev)

def split(fn, n=10):
    """Host and GPU time of ONE call (ms): ~100 ms of GPU work queued first, so its <1024 launches never wait and its
    kernels run back to back (events around them: GPU time); the host's own time by the clock. Median of n."""
    fn(); torch.cuda.synchronize()
    hosts, gpus = [], []
    for _ in range(n):
        busy()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); t = time.perf_counter(); fn(); hosts.append((time.perf_counter() - t) * 1e3); e.record()
        torch.cuda.synchronize(); gpus.append(s.elapsed_time(e))
    hosts.sort(); gpus.sort()
    return {"host_ms": round(hosts[n // 2], 3), "gpu_ms": round(gpus[n // 2], 3)}

def kernels(fn):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"))

steps = iter(range(10**6))
reused = NEW.Randomness(torch.Generator().manual_seed(1), g, random.Random(1))
for label, mod in (("old", OLD), ("new", NEW)):
    ta = mod.TrainTransform(224, [0.5] * 3, [0.5] * 3, crop_scale_min=0.08, auto_augment="trivialaugment").to(dev)
    crop = mod.TrainTransform(224, [0.5] * 3, [0.5] * 3, crop_scale_min=0.08).to(dev)
    cases = {f"ta_{label}": lambda: ta(x), f"crop_{label}": lambda: crop(x)}
    if mod is NEW:
        cases["ta_new_keyed"] = lambda: ta(x, NEW.Randomness.for_batch(42, 0, next(steps), 0, dev))
        cases["ta_new_reused_generators"] = lambda: ta(x, reused)
    for name, fn in cases.items():
        out[name] = {**split(fn), "launches": kernels(fn)}
print(json.dumps(out, indent=0))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "hostprobe.json"), "w"), indent=1)
