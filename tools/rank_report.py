"""run_image_classification.py, plus a report of what each rank actually trained with: for tests and benchmarks.

    accelerate launch --config_file accelerate_configs/zero3.yaml tools/rank_report.py --config ...
    deepspeed tools/rank_report.py --deepspeed ds_configs/zero2.json --config ...

Takes the script's arguments and runs the script; at the end of training every rank also writes
output_dir/rank_reports/rank{N}.json: world size, the wrapper the Trainer trained, ZeRO stage, and how many parameter
and optimizer-state elements this rank holds against the full model. Tests and benchmarks assert on it, so a launcher
that silently falls back to plain DDP (or to unconnected single processes) cannot pass. It lives outside the package:
a run never needs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

RANK_REPORT_DIR = "rank_reports"


def _local_numel(tensor) -> int:
    local = getattr(tensor, "to_local", None)  # FSDP2 DTensor: this rank's shard
    return int(local().numel()) if callable(local) else int(tensor.numel())


def _inner_optimizer(optimizer):
    """The torch optimizer holding the states (under accelerate's and DeepSpeed's wrappers)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def rank_report(trainer, precision: str) -> dict[str, Any]:
    """What this process trained with: enough to tell DDP, ZeRO-1/2/3 and FSDP2 apart, and sharded from not."""
    import torch
    import torch.distributed as dist

    wrapped = trainer.model_wrapped
    model = trainer.model
    initialized = dist.is_available() and dist.is_initialized()
    report: dict[str, Any] = {
        "rank": dist.get_rank() if initialized else 0,
        "world_size": dist.get_world_size() if initialized else 1,
        "args_world_size": trainer.args.world_size,
        "backend": dist.get_backend() if initialized else None,
        "device": str(trainer.args.device),
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "wrapper": f"{type(wrapped).__module__}.{type(wrapped).__name__}",
        "model_class": type(model).__name__,
        "is_deepspeed_enabled": bool(trainer.is_deepspeed_enabled),
        "is_fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "fsdp2": False,
        "zero_stage": None,
        "offload_optimizer": False,
        "offload_param": False,
        "gradient_checkpointing": bool(  # transformers 5.24 renamed it (the old name warns)
            model.is_activation_checkpointing
            if hasattr(model, "is_activation_checkpointing")
            else getattr(model, "is_gradient_checkpointing", False)
        ),
        "fsdp_activation_checkpointing": any(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules()),
        "precision": precision,
        "param_dtype": None,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
    }
    params = list(model.parameters())
    full = local = 0
    for p in params:
        if hasattr(p, "ds_numel"):  # ZeRO-3: the full tensor is gathered only around its use
            full += int(p.ds_numel)
            local += int(p.ds_tensor.numel())
        else:
            full += int(p.numel())
            local += _local_numel(p)
    report["param_numel_full"] = full
    report["param_numel_local"] = local
    if params:
        report["param_dtype"] = str(getattr(params[0], "ds_tensor", params[0]).dtype).replace("torch.", "")
    try:
        from torch.distributed.fsdp import FSDPModule

        report["fsdp2"] = isinstance(model, FSDPModule) or isinstance(wrapped, FSDPModule)
    except ImportError:
        pass
    if trainer.is_deepspeed_enabled and hasattr(wrapped, "zero_optimization_stage"):
        report["zero_stage"] = int(wrapped.zero_optimization_stage())
        report["offload_optimizer"] = bool(wrapped.zero_offload_optimizer())
        report["offload_param"] = bool(wrapped.zero_offload_param())
        report["gradients_partitioned"] = bool(wrapped.zero_optimization_partition_gradients())
        if wrapped.torch_autocast_enabled():  # DeepSpeed's own autocast, over fp32 weights
            report["deepspeed_autocast"] = str(wrapped.torch_autocast_dtype()).replace("torch.", "")
        from deepspeed.utils import get_z3_leaf_modules

        report["zero3_leaf_modules"] = sorted({type(m).__name__ for m in get_z3_leaf_modules(wrapped.module)})
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is not None:
        report["fsdp_plugin"] = {
            key: str(getattr(plugin, key, None))
            for key in (
                "fsdp_version",
                "reshard_after_forward",
                "activation_checkpointing",
                "state_dict_type",
                "cpu_offload",
                "transformer_cls_names_to_wrap",
                "mixed_precision_policy",
            )
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["cuda_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    optimizer = _inner_optimizer(getattr(trainer, "optimizer", None))
    if optimizer is not None:
        states = [s.get("exp_avg") for s in optimizer.state.values() if isinstance(s, dict)]
        states = [s for s in states if torch.is_tensor(s)]
        report["optimizer_class"] = type(optimizer).__name__
        # Adam's first moment: one element per trained parameter element this rank updates
        report["optimizer_state_numel_local"] = sum(_local_numel(s) for s in states)
        report["optimizer_state_device"] = str(states[0].device) if states else None
    return report


class RankReportCallback(TrainerCallback):
    """Writes `rank_report` for every rank at the end of training (after the optimizer has states)."""

    def __init__(self, trainer, precision: str):
        self.trainer = trainer
        self.precision = precision

    def on_train_end(self, args, state, control, **kwargs):
        report = rank_report(self.trainer, self.precision)
        report["global_step"] = state.global_step
        folder = Path(args.output_dir) / RANK_REPORT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the script, run from any working directory
    import run_image_classification as script

    build_trainer = script.build_trainer

    def build_trainer_with_report(args, plan, *rest):
        trainer, meter = build_trainer(args, plan, *rest)
        trainer.add_callback(RankReportCallback(trainer, plan.precision))
        return trainer, meter

    script.build_trainer = build_trainer_with_report
    script.cli()


if __name__ == "__main__":
    main()
