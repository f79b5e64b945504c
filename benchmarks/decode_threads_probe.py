"""Probe (issue 48): decode_to_chw on 3,000 photos of the 60,000-JPEG folder in threads of one process and in 16
processes; run on the device after benchmarks.wall_clock wrote /tmp/wc/jpegs_60000. Cited by
benchmarks/results/2026-12-02_stream_decoders_1xH200, then deleted."""

import glob
import io
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from PIL import Image

sys.path.insert(0, "src")
from vit_recipes.images import decode_to_chw

files = sorted(glob.glob("/tmp/wc/jpegs_60000/train/*/*.jpg"))[:3000]
blobs = [{"bytes": open(f, "rb").read(), "path": None} for f in files]


def full(v):
    return decode_to_chw(v, 256, 256, None)


def pil_only(v):
    im = Image.open(io.BytesIO(v["bytes"]))
    im.draft("RGB", (340, 256))
    im.load()
    return im.size


def run(fn, n, pool):
    t = time.perf_counter()
    if n == 1:
        [fn(b) for b in blobs]
    else:
        with pool(n) as p:
            list(p.map(fn, blobs, chunksize=16 if pool is ProcessPoolExecutor else 1))
    return len(blobs) / (time.perf_counter() - t)


for name, fn in (("decode_to_chw", full), ("open+draft+load", pil_only)):
    for n in (1, 4, 8, 16):
        print(f"{name} threads={n}: {run(fn, n, ThreadPoolExecutor):.0f} img/s", flush=True)
print(f"decode_to_chw processes=16: {run(full, 16, ProcessPoolExecutor):.0f} img/s", flush=True)
