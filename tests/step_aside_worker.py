"""One process of a launch on a machine that has 2 GPUs, on the CPU: launch.check_processes meets the count it
would see there, then the processes it kept form a gloo group and all-reduce once, and each writes a report.

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 3 tests/step_aside_worker.py OUT

The GPU count is replaced here, around the package, so that no test hook lives in it."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vit_recipes.core import launch

launch.visible_gpus = lambda: 2
launch.check_processes(use_cpu=False)  # local ranks 2.. exit here, status 0
time.sleep(3)  # the agent has seen the early exits by now (it polls every 0.1 s): the kept ones go on regardless
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(),
          "note": launch.stepped_aside_note(global_batch=16)}  # fmt: skip
Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
dist.barrier()
dist.destroy_process_group()
