"""One rank of the FSDP2 layout check, started by `accelerate launch --config_file accelerate_configs/fsdp*.yaml`.

accelerate runs FSDP only on GPUs, but the sharding itself (torch's fully_shard over gloo) works on the CPU. So this
worker takes the FSDP plugin exactly as `accelerate launch` built it from our YAML (the FSDP_* environment), applies
it with accelerate's own fsdp2_apply_ac + fsdp2_prepare_model to a tiny ViT, trains a few fp32 steps on its half of
a fixed global batch, and writes what it held and the losses to <out>/rank{N}.json for the test to assert on.
The whole script under FSDP2 is proven on GPUs (benchmarks/gpu_strategies.sh).

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \\
        tests/fsdp2_cpu_worker.py MODEL_DIR OUT_DIR STEPS [lora]

With `lora`, the model is first wrapped by our LoRA set-up (vit_recipes.lora.apply_lora: query/value adapters plus
the full head), as `--use_peft` does before the Trainer hands it to accelerate. After training, the worker then saves
the adapter the way the script does under FSDP2 (`save_adapter`): our save_final_model with the Trainer's own
save_model/_save (accelerator.get_state_dict -> PeftModel.save_pretrained(state_dict=...)), once as an adapter into
<out>/adapter and once merged (--merge_adapter) into <out>/merged, next to <out>/trained.safetensors: the trained
adapter and head, gathered straight from the shards, for the test to compare the files with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_canonicalize_names, fsdp2_prepare_model
from transformers import ViTForImageClassification

from vit_recipes.adapters import save_final_model
from vit_recipes.arguments import LoraArguments, ModelArguments
from vit_recipes.checks import check_fsdp_wrap
from vit_recipes.lora import apply_lora, base_signature
from vit_recipes.modeling import FinetuneSetup
from vit_recipes.plan import read_strategy


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
    from vit_recipes.trainer import ImageClassificationTrainer

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


def main(model_dir: str, out_dir: str, steps: int, lora: bool = False) -> None:
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

    losses = []
    for pixels, labels in fixed_batches(model.config, steps):  # PeftModel forwards .config
        share = pixels.shape[0] // world
        mine = slice(rank * share, (rank + 1) * share)
        loss = model(pixel_values=pixels[mine], labels=labels[mine]).loss
        loss.backward()  # FSDP2 reduce-scatters the mean gradient over ranks: the full batch's gradient
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        torch.distributed.all_reduce(whole)
        losses.append(whole.item() / world)

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
        "losses": losses,
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
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), lora=sys.argv[4:] == ["lora"])
