"""One rank of the FSDP2 layout check, started by `accelerate launch --config_file accelerate_configs/fsdp*.yaml`.

accelerate runs FSDP only on GPUs, but the sharding itself (torch's fully_shard over gloo) works on the CPU. So this
worker takes the FSDP plugin exactly as `accelerate launch` built it from our YAML (the FSDP_* environment), applies
it with accelerate's own fsdp2_apply_ac + fsdp2_prepare_model to a tiny ViT, trains a few fp32 steps on its half of
a fixed global batch, and writes what it held and the losses to <out>/rank{N}.json for the test to assert on.
The whole script under FSDP2 is proven on GPUs by the acceptance suite (benchmarks/acceptance.py).

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \\
        tests/fsdp2_cpu_worker.py MODEL_DIR OUT_DIR STEPS [lora] [--save-at K --checkpoint DIR] [--resume-from DIR]

With `lora`, the model is first wrapped by our LoRA set-up (vit_recipes.model.lora.apply_lora: query/value adapters plus
the full head), as `--use_peft` does before the Trainer hands it to accelerate. After training, the worker then saves
the adapter the way the script does under FSDP2 (`save_adapter`): our save_final_model with the Trainer's own
save_model/_save (accelerator.get_state_dict -> PeftModel.save_pretrained(state_dict=...)), once as an adapter into
<out>/adapter and once merged (--merge_adapter) into <out>/merged, next to <out>/trained.safetensors: the trained
adapter and head, gathered straight from the shards, for the test to compare the files with.

With `--save-at K --checkpoint DIR`, the worker saves after step K what the Trainer's checkpoint holds for resuming
under FSDP (`_save_optimizer_and_scheduler`: accelerate's save_fsdp_model + save_fsdp_optimizer, in the plugin's
state-dict type) plus the step reached, and trains on. With `--resume-from DIR`, it loads that model and optimizer
state as the Trainer does on resume (`_load_from_checkpoint` + `_load_optimizer_and_scheduler`: load_fsdp_model +
load_fsdp_optimizer, after the model is sharded and the optimizer created) and continues the same fixed batches from
step K+1 to STEPS, in however many processes it was launched with: the global batch stays 8, split over the ranks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_canonicalize_names, fsdp2_prepare_model
from transformers import ViTForImageClassification
from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

from vit_recipes.core.arguments import LoraArguments, ModelArguments
from vit_recipes.core.launch import shutdown
from vit_recipes.model.adapters import save_final_model
from vit_recipes.model.lora import apply_lora, base_signature
from vit_recipes.model.modeling import FinetuneSetup
from vit_recipes.plan.checks import check_fsdp_wrap
from vit_recipes.plan.plan import read_strategy


def fixed_batches(config, steps: int, batch: int = 8):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pixels = torch.randn(batch, 3, config.image_size, config.image_size, generator=generator)
        yield pixels, torch.randint(0, config.num_labels, (batch,), generator=generator)


def load(model_dir: str, lora: bool):
    model = ViTForImageClassification.from_pretrained(model_dir)
    if lora:
        torch.manual_seed(0)  # the adapters' initialisation, the same in every process and in the reference
        # no LoRA dropout: each rank would draw masks for its half-batch, the reference for the whole one
        model, _ = apply_lora(model, LoraArguments(use_peft=True, lora_dropout=0.0))
    return model


def save_adapter(accelerator, model, output_dir: Path, setup: FinetuneSetup) -> None:
    """What the script's save does after FSDP2 training, on every rank: our save_final_model, with the Trainer's own
    save_model and _save (transformers' code, not a copy) on a Trainer that holds only what they read.

    The Trainer itself is not built here: its Accelerator would refuse FSDP on the CPU (so would the script).
    """
    from vit_recipes.train.trainer import ImageClassificationTrainer

    trainer = ImageClassificationTrainer.__new__(ImageClassificationTrainer)
    main_process = accelerator.is_main_process
    trainer.__dict__.update(
        model=model,  # the Trainer's self.model under FSDP2: the prepared (sharded, wrapped) PeftModel
        model_wrapped=model,
        accelerator=accelerator,
        args=SimpleNamespace(
            output_dir=str(output_dir),
            should_save=main_process,
            process_index=accelerator.process_index,
            push_to_hub=False,
            hub_revision=None,
        ),
        is_fsdp_enabled=True,
        is_deepspeed_enabled=False,
        is_fsdp_xla_v1_enabled=False,
        is_distributed_loading_by_transformers=False,
        processing_class=None,
        data_collator=None,
    )
    save_final_model(trainer, setup)
    if main_process:  # the script then writes the labels' config next to it
        model.config.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


STEP_FILE = "worker_step.json"  # the step reached (the Trainer reads it from trainer_state.json)


def save_checkpoint(accelerator, plugin, model, optimizer, folder: Path, step: int) -> None:
    """The FSDP part of the Trainer's _save_optimizer_and_scheduler, with its arguments: every rank takes part (the
    state is gathered from the shards); under FULL_STATE_DICT rank 0 writes pytorch_model_fsdp.bin and optimizer.bin."""
    save_fsdp_model(plugin, accelerator, model, str(folder), **get_fsdp_ckpt_kwargs())
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(folder))
    if accelerator.is_main_process:
        (folder / STEP_FILE).write_text(json.dumps({"global_step": step, "world_size": accelerator.num_processes}))
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, plugin, model, optimizer, folder: Path) -> int:
    """What the Trainer's _prepare_for_training does on resume under FSDP, after the model is prepared and the
    optimizer created: _load_from_checkpoint (load_fsdp_model) then _load_optimizer_and_scheduler
    (load_fsdp_optimizer), with its arguments. Returns the step the checkpoint was saved after."""
    load_fsdp_model(plugin, accelerator, model, str(folder), **get_fsdp_ckpt_kwargs())
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(folder), **get_fsdp_ckpt_kwargs())
    return json.loads((folder / STEP_FILE).read_text())["global_step"]


def main(
    model_dir: str,
    out_dir: str,
    steps: int,
    lora: bool = False,
    save_at: int | None = None,
    checkpoint: str | None = None,
    resume_from: str | None = None,
) -> None:
    accelerator = Accelerator(cpu=True)  # a gloo process group over the ranks accelerate launch started
    plugin = FullyShardedDataParallelPlugin()  # filled from the FSDP_* variables accelerate launch set
    accelerator.state.fsdp_plugin = plugin
    # FSDP as the Trainer's Accelerator has it on GPUs (the CPU one says MULTI_CPU): get_state_dict then takes its
    # FSDP2 path, the full state dict gathered to rank 0. Nothing else here reads it.
    accelerator.state.distributed_type = DistributedType.FSDP
    assert accelerator.is_fsdp2
    rank, world = accelerator.process_index, accelerator.num_processes

    model = load(model_dir, lora)
    signature = base_signature(model) if lora else None  # of the frozen base, as build_finetune_model records it
    check_fsdp_wrap(
        read_strategy(SimpleNamespace(world_size=2)), model
    )  # our refusal must let the shipped config through
    full = {name: p.numel() for name, p in model.named_parameters()}
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    model = fsdp2_prepare_model(accelerator, model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    start = load_checkpoint(accelerator, plugin, model, optimizer, Path(resume_from)) if resume_from else 0

    losses = []
    batches = fixed_batches(model.config, steps)  # PeftModel forwards .config
    for step, (pixels, labels) in enumerate(batches, start=1):
        if step <= start:  # drawn all the same: the batches after the checkpoint are those of the whole run
            continue
        share = pixels.shape[0] // world
        mine = slice(rank * share, (rank + 1) * share)
        loss = model(pixel_values=pixels[mine], labels=labels[mine]).loss
        loss.backward()  # FSDP2 reduce-scatters the mean gradient over ranks: the full batch's gradient
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        torch.distributed.all_reduce(whole)
        losses.append(whole.item() / world)
        if step == save_at:
            save_checkpoint(accelerator, plugin, model, optimizer, Path(checkpoint), step)

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    local = {
        name: (p.to_local().numel() if isinstance(p, DTensor) else p.numel()) for name, p in model.named_parameters()
    }
    report = {
        "rank": rank,
        "world_size": world,
        "wrap_classes": plugin.transformer_cls_names_to_wrap,
        "activation_checkpointing": bool(plugin.activation_checkpointing),
        # FSDP2 units by the class they shard (fully_shard subclasses it as FSDP<Class>)
        "fsdp_units": sorted(
            next(c for c in type(m).__bases__ if c is not FSDPModule).__name__
            for m in model.modules()
            if isinstance(m, FSDPModule)
        ),
        "checkpointed_layers": sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules()),
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        "params": len(full),
        "trainable_params": sum(p.requires_grad for p in model.parameters()),
        "trainable_dtensors": sum(isinstance(p, DTensor) and p.requires_grad for p in model.parameters()),
        "full_numel": sum(full.values()),
        "local_numel": sum(local.values()),
        "first_step": start + 1,
        "losses": losses,  # of steps first_step..STEPS
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if lora:
        # the trained adapters and head, each gathered from its shards (a collective: every rank, same order)
        trained = {
            name: p.full_tensor().detach().clone()
            for name, p in fsdp2_canonicalize_names(dict(model.named_parameters())).items()
            if p.requires_grad
        }
        if rank == 0:
            from safetensors.torch import save_file

            save_file(trained, out / "trained.safetensors")
        labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
        for name, merge in (("adapter", False), ("merged", True)):
            setup = FinetuneSetup("lora", merge, ModelArguments(model_name_or_path=model_dir), labels, {}, signature)
            save_adapter(accelerator, model, out / name, setup)
        report["saved"] = sorted(p.name for p in out.iterdir() if p.is_dir())
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    # The process group down before exit, as the script does: left up, gloo's threads can abort a rank at exit
    # ("terminate called without an active exception", seen once in about 20 runs)
    shutdown()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("lora", nargs="?", choices=["lora"])
    parser.add_argument("--save-at", type=int, help="save a checkpoint after this step (into --checkpoint)")
    parser.add_argument("--checkpoint", help="the folder --save-at saves into")
    parser.add_argument("--resume-from", help="a folder --save-at wrote: continue after its step")
    args = parser.parse_args(argv)
    if (args.save_at is None) != (args.checkpoint is None):
        parser.error("--save-at and --checkpoint go together")
    return args


if __name__ == "__main__":
    args = parse()
    main(
        args.model_dir,
        args.out_dir,
        args.steps,
        lora=args.lora == "lora",
        save_at=args.save_at,
        checkpoint=args.checkpoint,
        resume_from=args.resume_from,
    )
