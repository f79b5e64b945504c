"""Probe (kept one commit for its record, 2026-11-28_augment_launches_2xH200; needs transforms_old.py as
augment_host_probe.py says): what the device augmentation costs per ViT-B training step (HEAD e718606 vs crop+warp in one pass, keyed draws)."""
import json, sys, time, os
import torch
sys.path.insert(0, os.path.dirname(__file__))
import transforms_old as OLD
from vit_recipes import transforms as NEW
from transformers import ViTConfig, ViTForImageClassification

torch.backends.cuda.matmul.allow_tf32 = True
dev = torch.device("cuda")
model = ViTForImageClassification(ViTConfig(num_labels=100)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
MEAN, STD = [0.5] * 3, [0.5] * 3
B = 128
results = {}

def make(mod, storage, policy):
    t = mod.TrainTransform(224, MEAN, STD, crop_scale_min=0.25, auto_augment=policy)
    return t.to(dev)

def run(name, storage, transform, steps=40, warm=10, keyed=False):
    cpu = torch.randint(0, 256, (8, B, 3, storage, storage), dtype=torch.uint8).pin_memory()
    labels = torch.randint(0, 100, (B,), device=dev)
    def step(i):
        x = cpu[i % 8].to(dev, non_blocking=True)
        rng = NEW.Randomness.for_batch(42, 0, i, 0, dev) if keyed else None
        x = (transform(x, rng) if keyed else transform(x)) if transform is not None else x.float().div(255)[:, :, :224, :224] if storage >= 224 else torch.nn.functional.interpolate(x.float(), size=224)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits.float(), labels)
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    for i in range(warm):
        step(i)
    torch.cuda.synchronize(); t = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / steps
    # augment alone: GPU time by events, CPU time by wall without sync
    aug_gpu = aug_cpu = None
    if transform is not None:
        x = cpu[0].to(dev)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); t0 = time.perf_counter(); s.record()
        for i in range(20):
            transform(x, NEW.Randomness.for_batch(42, 0, i, 0, dev)) if keyed else transform(x)
        e.record(); aug_cpu = (time.perf_counter() - t0) / 20; torch.cuda.synchronize(); aug_gpu = s.elapsed_time(e) / 20 / 1000
    results[name] = {"step_ms": dt * 1e3, "img_s": B / dt, "aug_gpu_ms": aug_gpu and aug_gpu * 1e3, "aug_cpu_ms": aug_cpu and aug_cpu * 1e3}
    print(name, json.dumps(results[name]), flush=True)

run("model-only-224", 224, None)

run("food-256-crop", 256, make(NEW, 256, "none"))
run("food-256-ta-old", 256, make(OLD, 256, "trivialaugment"))
run("food-256-ta-new", 256, make(NEW, 256, "trivialaugment"))
run("food-256-ta-new-keyed", 256, make(NEW, 256, "trivialaugment"), keyed=True)
run("food-256-ta-old-again", 256, make(OLD, 256, "trivialaugment"))
run("cifar-32-crop", 32, make(NEW, 32, "none"))

# syncs: count in the new transform
x = torch.randint(0, 256, (B, 3, 256, 256), dtype=torch.uint8, device=dev)
for label, mod in (("old", OLD), ("new", NEW)):
    t = make(mod, 256, "trivialaugment")
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        t(x)
        torch.cuda.set_sync_debug_mode(0)
    results[f"syncs-{label}"] = len(w)
    print("syncs", label, len(w), [str(i.message)[:80] for i in w[:3]], flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "augbench.json"), "w"), indent=1)
