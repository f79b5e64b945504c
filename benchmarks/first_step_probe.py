"""Probe. Question: where do the seconds before the first step go on a folder of JPEGs decoded per batch? Runs
run_image_classification.main with time stamps at the DataLoader iterator's start, each worker's first batch, the
main process's first batches and training steps, evaluations and checkpoints. Ran from .probe/run_probed.py; record:
results/2026-11-28_data_path_scale_1xH200. Deleted once recorded."""
import os, sys, time
sys.path.insert(0, os.getcwd())
from vit_recipes.timeline import seconds_since_start
START = time.time() - seconds_since_start()
def stamp(msg):
    sys.stderr.write(f"[probe pid={os.getpid()} t={time.time() - START:7.3f}] {msg}\n")
import torch.utils.data.dataloader as D
import transformers
from vit_recipes import decoding
import run_image_classification as R
stamp("imports done")

init = D._MultiProcessingDataLoaderIter.__init__
def init_(self, loader):
    stamp(f"iter start workers={loader.num_workers} batch={loader.batch_size}")
    init(self, loader)
    stamp("iter ready (workers forked)")
    self._probe_n = 0
D._MultiProcessingDataLoaderIter.__init__ = init_
nxt = D._MultiProcessingDataLoaderIter._next_data
def nxt_(self):
    out = nxt(self)
    self._probe_n = getattr(self, "_probe_n", 0) + 1
    if self._probe_n <= 3 or self._probe_n % 50 == 0:
        stamp(f"main got batch {self._probe_n}")
    return out
D._MultiProcessingDataLoaderIter._next_data = nxt_
seen = {}
call = decoding.DecodingCollator.__call__
def call_(self, rows):
    pid = os.getpid(); n = seen.get(pid, 0); seen[pid] = n + 1
    t = time.time()
    out = call(self, rows)
    if n < 2:
        stamp(f"worker collated {len(rows)} rows in {time.time() - t:.3f}s (call {n + 1})")
    return out
decoding.DecodingCollator.__call__ = call_
ts = transformers.Trainer.training_step
count = [0]
def ts_(self, *a, **k):
    count[0] += 1
    if count[0] <= 3 or count[0] % 50 == 0:
        stamp(f"training_step {count[0]} begin")
    return ts(self, *a, **k)
transformers.Trainer.training_step = ts_
for name in ("evaluate", "_save_checkpoint", "train", "predict"):
    f = getattr(transformers.Trainer, name)
    def wrap(f=f, name=name):
        def g(self, *a, **k):
            stamp(f"{name} begin")
            try:
                return f(self, *a, **k)
            finally:
                stamp(f"{name} end")
        return g
    setattr(transformers.Trainer, name, wrap())
R.main(sys.argv[1:])
stamp("main returned")
