"""Refusals, each one `RecipeError` line: `check_plan` before data loads, `check_model` once the model is built."""

import glob
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch

from ..core.errors import RecipeError
from ..core.hub import (
    LOCAL_BUILDERS,
    check_local_path,
    check_push_ready,
    hub_error_message,
    offline_env,
    reachable_or_cached,
    written_as_path,
)
from ..core.launch import is_true, visible_gpus
from ..data.data import resolve_source
from ..model.levers import add_drop_path, transformer_layers
from ..model.patch_dropout import token_embeddings
from .memory import host_memory_for
from .run_dir import WRITE_PROBE


def config_value(config: dict | None, dotted: str):
    """`config["a"]["b"]` for "a.b", None where any part is missing."""
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def turned_on(config: dict | None, section: str) -> bool:
    """A DeepSpeed section whose "enabled" is true, or "auto" (the arguments will decide)."""
    enabled = config_value(config, f"{section}.enabled")
    return enabled == "auto" or is_true(enabled)


def check_plan(plan, args) -> None:
    """Reject, in one line each, settings that would fail (or silently do something else) later."""
    t, strategy, cpu = args.training, plan.strategy, plan.device == "cpu"
    if strategy.deepspeed and strategy.fsdp:
        raise RecipeError(
            f"both DeepSpeed ({strategy.deepspeed_source}) and FSDP are configured: pick one (an accelerate FSDP "
            "config without --deepspeed, or a DeepSpeed config without --fsdp)"
        )
    if strategy.fsdp and cpu:
        raise RecipeError(
            "FSDP needs GPUs: on the CPU it does not shard (the Trainer falls back to DDP, accelerate starts "
            "unconnected processes); use accelerate_configs/ddp.yaml or a ds_configs/zero*.json on the CPU"
        )
    if plan.precision == "fp16" and cpu:
        raise RecipeError(
            "fp16 needs a GPU and this run is on the CPU: drop --fp16 (CPU runs in fp32, or bf16 with --bf16 true)"
        )
    gpus = 0 if cpu else visible_gpus()
    if strategy.world_size == 1 and not strategy.deepspeed and not strategy.fsdp and gpus > 1:
        raise RecipeError(
            f"{gpus} GPUs are visible to one process: the Trainer would split each batch over them with torch.nn."
            "DataParallel (seen 6x slower than one GPU); launch one process per GPU with `accelerate launch "
            "--multi_gpu` (or a config from accelerate_configs/), or pick one GPU with CUDA_VISIBLE_DEVICES=0"
        )
    if plan.precision == "bf16" and plan.device == "cuda" and not gpu_bf16_ok():
        raise RecipeError("bf16 is not supported by this GPU (it needs Ampere or newer): use --fp16 true instead")
    asked = {"torch_compile_regions": getattr(t, "torch_compile_regions", False), "fp8": getattr(t, "fp8", False)}
    asked.update(lora=args.lora.use_peft, ema=t.ema_decay > 0)
    for feature, on in asked.items():  # what the strategy's table row refuses
        if on and not strategy.spec.supports(feature):
            refusal, source = strategy.spec.refusals[feature], strategy.deepspeed_source
            raise RecipeError(f"{source}: {refusal}" if source else refusal)
    if strategy.deepspeed:
        _check_deepspeed(plan, t)
    if strategy.offload_optimizer or strategy.offload_params:
        check_host_memory(strategy, plan.model)
    if getattr(t, "fp8", False):
        check_fp8(cpu, t, args.lora.use_peft)
    if t.gradient_checkpointing or args.augment.patch_dropout or t.layer_decay < 1 or args.model.drop_path_rate:
        check_model_family(args, plan.model)
    check_resume(strategy, plan.resume_from)  # before the output dir's refusal: it says more about ZeRO shards
    if plan.output.refusal:
        raise RecipeError(plan.output.refusal)
    if t.process_index == 0:
        check_output_dir(t, args.model)


def check_output_dir(training_args, model_args) -> None:
    """The output directory is writable and, for training, has room for what the run saves (before data loads)."""
    out = Path(training_args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out, prefix=WRITE_PROBE).close()  # created and deleted
    except OSError as err:
        raise RecipeError(
            f"output_dir {out} is not writable ({err.strerror or err}): choose another --output_dir"
        ) from None
    source = model_args.model_name_or_path  # only a local checkpoint's size is known
    folder = Path(source).expanduser() if source else None
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder and folder.is_dir() else 0
    if not (training_args.do_train and weights):
        return
    checkpoints = str(getattr(training_args.save_strategy, "value", training_args.save_strategy)) != "no"
    needed = weights * (3 if checkpoints else 1)  # a checkpoint: the weights and Adam's two moments (fp32 each)
    if (free := shutil.disk_usage(out).free) < needed:
        what = "a checkpoint" if checkpoints else "the final model"
        raise RecipeError(
            f"output_dir {out} has {free / 2**30:.1f} GiB free and {what} of this model needs about "
            f"{needed / 2**30:.1f} GiB: free space or choose another --output_dir"
        )


def gpu_bf16_ok() -> bool:
    return bool(torch.cuda.is_bf16_supported())


def deepspeed_conflicts(config: dict, t, global_batch: int, world_size: int) -> list[str]:
    """Fixed (non-"auto") DeepSpeed values that disagree with the arguments, as 'key=value vs --flag value'."""
    per_device, accumulation = t.per_device_train_batch_size, t.gradient_accumulation_steps
    batch = f"the global batch (per-device {per_device} x accumulation {accumulation} x {world_size} processes) ="
    checks = [
        ("train_micro_batch_size_per_gpu", per_device, "--per_device_train_batch_size"),
        ("gradient_accumulation_steps", accumulation, "--gradient_accumulation_steps"),
        ("train_batch_size", global_batch, batch),
        ("gradient_clipping", t.max_grad_norm, "--max_grad_norm"),
        ("optimizer.params.lr", t.learning_rate, "--learning_rate"),
        ("optimizer.params.betas", [t.adam_beta1, t.adam_beta2], "--adam_beta1/--adam_beta2"),
        ("optimizer.params.eps", t.adam_epsilon, "--adam_epsilon"),
        ("optimizer.params.weight_decay", t.weight_decay, "--weight_decay"),
        ("scheduler.params.warmup_max_lr", t.learning_rate, "--learning_rate"),
        ("fp16.enabled", bool(t.fp16), "--fp16"),
        ("bf16.enabled", bool(t.bf16), "--bf16"),
    ]
    out = []
    for key, value, flag in checks:
        if (fixed := config_value(config, key)) not in (None, "auto") and not _same(fixed, value):
            shown = str(value).lower() if isinstance(value, bool) else value
            out.append(f"{key}={json.dumps(fixed)} vs {flag} {shown}")
    # torch_autocast fixed on asks for 16 bits and its dtype; fixed off leaves precision to a bf16/fp16 section or fp32
    if is_true(config_value(config, "torch_autocast.enabled")) and not (t.fp16 or t.bf16):
        out.append("torch_autocast.enabled=true vs --bf16/--fp16 false")
    dtype = str(config_value(config, "torch_autocast.dtype") or "auto").lower().removeprefix("torch.")
    spelled = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)  # DeepSpeed's spellings
    wanted = "float16" if t.fp16 else "bfloat16"
    if turned_on(config, "torch_autocast") and (t.fp16 or t.bf16) and dtype != "auto" and spelled != wanted:
        out.append(f"torch_autocast.dtype={json.dumps(dtype)} vs --{'fp16' if t.fp16 else 'bf16'} true")
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return is_true(a) == is_true(b)
    try:
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return a == b


def _check_deepspeed(plan, t) -> None:
    strategy, name = plan.strategy, plan.strategy.deepspeed_source
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise RecipeError(
            "DeepSpeed is not installed: pip install 'vit-recipes[deepspeed]' (on a CPU-only machine: "
            "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)"
        ) from None
    if strategy.from_accelerate and is_true(os.environ.get("ACCELERATE_USE_CPU")):
        raise RecipeError(
            "DeepSpeed cannot run with accelerate's use_cpu/--cpu (accelerate then skips DeepSpeed's setup): "
            "keep use_cpu: false in the accelerate config and pass --use_cpu true to the script instead"
        )
    if strategy.from_accelerate and plan.precision in ("fp16", "bf16") and not (t.fp16 or t.bf16):
        raise RecipeError(
            f"accelerate --mixed_precision {plan.precision} without --{plan.precision} true: under DeepSpeed the "
            f"Trainer would stop at its first step (bf16/fp16 mismatch); pass --{plan.precision} true to the script "
            "instead"
        )
    if conflicts := deepspeed_conflicts(strategy.deepspeed_config, t, plan.global_batch, strategy.world_size):
        raise RecipeError(
            f'{name} conflicts with the arguments: {"; ".join(conflicts)}. Set these to "auto" in the JSON '
            "so the arguments decide, or change the arguments to match"
        )
    if strategy.autocast:
        if mode := next((m for m in ("bf16", "fp16") if turned_on(strategy.deepspeed_config, m)), None):
            raise RecipeError(
                f'{name} has both "torch_autocast" and an enabled or "auto" "{mode}" section: keep one '
                f"(torch_autocast: fp32 weights, as under DDP; {mode}: 16-bit weights; docs/distributed.md)"
            )
        if plan.precision == "fp16":  # measured: benchmarks/results/2026-11-27_zero_fp16_fp32_2xH200
            raise RecipeError(
                f"{name} trains through DeepSpeed's torch_autocast, whose fp16 loss scaling clips gradients by their "
                "scaled norm (65,536x DDP's) and learns more slowly than DDP in fp16: use --bf16 true, or a config "
                'with an "fp16" section in place of "torch_autocast" (as ds_configs/zero2_offload.json has)'
            )
    if t.layer_decay < 1 and config_value(strategy.deepspeed_config, "optimizer"):
        raise RecipeError(
            f"{name} builds its own optimizer, one learning rate for all parameters: --layer_decay needs the "
            "Trainer's (remove the JSON's \"optimizer\" section) or drop --layer_decay"
        )
    hpz = config_value(strategy.deepspeed_config, "zero_optimization.zero_hpz_partition_size")
    if isinstance(hpz, int) and hpz > 1 and strategy.world_size % hpz:
        raise RecipeError(
            f"{name}: zero_hpz_partition_size {hpz} does not divide the {strategy.world_size} processes: set it to "
            "the number of GPUs per node"
        )


def check_model_family(args, facts) -> None:
    """Refuse, before data loads, checkpointing, patch dropout, layer decay or drop path where the family lacks it."""
    from accelerate import init_empty_weights

    if facts.config is None or facts.classifier is None:  # no config, or no classifier for it: build_model says why
        return
    config, model_class = facts.fresh_config(), facts.classifier
    with init_empty_weights():  # on the meta device: no memory, no weights read
        model = model_class(config)  # timm's wrapper says on the instance whether its model checkpoints
    if args.training.gradient_checkpointing and not model.supports_gradient_checkpointing:
        raise RecipeError(
            f"--gradient_checkpointing: transformers has no activation checkpointing for {model_class.__name__}; "
            "drop the flag (or lower the batch size to fit memory)"
        )
    if args.augment.patch_dropout:
        token_embeddings(model)
    if args.training.layer_decay < 1:
        transformer_layers(model)
    if args.model.drop_path_rate and not hasattr(config, "drop_path_rate"):
        add_drop_path(model, args.model.drop_path_rate)


def check_host_memory(strategy, facts) -> None:
    """Offloading keeps optimizer states (and maybe parameters) in host RAM: refuse when it cannot fit."""
    import psutil

    try:
        params, largest = facts.size
    except (RecipeError, ValueError, OSError, AttributeError):  # no config to read, or to size: build_model says why
        return
    if (needed := host_memory_for(strategy, params, largest)) > (available := psutil.virtual_memory().available):
        raise RecipeError(
            f"{strategy.spec.label} needs about {needed / 2**30:.1f} GiB of host memory on this node for "
            f"{params / 1e6:.0f}M parameters but {available / 2**30:.1f} GiB is available: use a configuration "
            "without offload, more nodes, or a machine with more memory (python tools/advise.py shows the options)"
        )


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_fp8(on_cpu: bool, t, lora: bool = False) -> None:
    """--fp8 needs its backend installed and FP8 tensor cores (the strategy table refuses sharded strategies)."""
    if t.fp8_backend == "transformer_engine":
        if on_cpu:
            raise RecipeError(
                "--fp8_backend transformer_engine needs a CUDA GPU: on the CPU use --fp8_backend torchao"
            )
        if not installed("transformer_engine"):
            raise RecipeError("--fp8_backend transformer_engine needs pip install 'transformer-engine[pytorch]'")
        # Recomputation reruns TE's FP8 modules (and scaling history); TE runs eagerly; peft wraps TE's linears.
        refused = ["--gradient_checkpointing"] * bool(t.gradient_checkpointing) + ["--use_peft"] * lora
        refused += ["--torch_compile_regions true"] * bool(t.torch_compile_regions)
        if refused:
            raise RecipeError(
                f"--fp8_backend transformer_engine with {refused[0]} is untested: use --fp8_backend torchao"
            )
    elif not installed("torchao"):
        raise RecipeError("--fp8 needs torchao: pip install 'vit-recipes[fp8]' (or pip install torchao)")
    if not on_cpu and torch.cuda.is_available() and (capability := torch.cuda.get_device_capability()) < (8, 9):
        raise RecipeError(
            f"--fp8 needs FP8 tensor cores (compute capability 8.9+, e.g. H100, H200, L40S); this GPU is "
            f"{capability[0]}.{capability[1]}: drop --fp8"
        )


def deepspeed_checkpoint_world_size(checkpoint: str | os.PathLike) -> int | None:
    """Data-parallel world size a DeepSpeed checkpoint was written with (one optimizer shard per rank)."""
    folder = Path(checkpoint)
    tags = [(folder / "latest").read_text().strip()] if (folder / "latest").is_file() else []
    tags += [p.name for p in sorted(folder.glob("global_step*")) if p.is_dir()]
    optim_file = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
    for tag in tags:
        if ranks := {int(m.group(1)) for f in glob.glob(str(folder / tag / "*")) if (m := optim_file.search(f))}:
            return max(ranks) + 1
    return None


def check_resume(strategy, checkpoint: str | None) -> None:
    """A DeepSpeed checkpoint resumes only under DeepSpeed; ZeRO-3 only on its own process count (ZeRO-1/2: any)."""
    if not checkpoint:
        return
    saved = deepspeed_checkpoint_world_size(checkpoint)
    if saved is not None and not strategy.deepspeed:
        raise RecipeError(
            f"{checkpoint} is a DeepSpeed checkpoint ({saved} processes): resume it with the same DeepSpeed "
            "config, or start a fresh run in another --output_dir"
        )
    if saved is None and strategy.deepspeed and (Path(checkpoint) / "trainer_state.json").is_file():
        raise RecipeError(
            f"{checkpoint} was not written by DeepSpeed: resume it with the strategy that wrote it, or start a "
            "fresh run in another --output_dir"
        )
    if saved not in (None, strategy.world_size) and strategy.zero_stage == 3:
        raise RecipeError(
            f"{checkpoint} was written by {saved} ZeRO-3 processes and this run has {strategy.world_size}: ZeRO-3 "
            f"resumes on the process count that wrote it. Launch {saved} processes, or convert it with "
            f"`python {checkpoint}/zero_to_fp32.py` and fine-tune from the result in a new --output_dir"
        )


def check_model(strategy, model) -> None:
    """FSDP2's wrap list; ZeRO++ quantized weights (qwZ) need gathered shards of 8k values (a leaf module is one)."""
    check_fsdp_wrap(strategy, model)
    if not is_true(config_value(strategy.deepspeed_config, "zero_optimization.zero_quantized_weights")):
        return
    world = strategy.world_size
    leaf_classes = set(config_value(strategy.deepspeed_config, "zero_optimization.leaf_module.classes") or [])
    inside_leaf: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside_leaf:
            continue
        if leaf := type(module).__name__ in leaf_classes:
            inside_leaf.update(id(m) for m in module.modules())
        sizes = [getattr(q, "ds_numel", q.numel()) for q in module.parameters(recurse=leaf)]
        if (shard := sum(-(-size // world) for size in sizes)) % 8:
            raise RecipeError(
                f"{strategy.deepspeed_source}: ZeRO++ quantized weights need each gathered shard to hold a multiple "
                f"of 8 values, but {name or type(model).__name__}'s {sum(sizes):,} parameters split into {shard:,} "
                f"per process over {world}: set zero_quantized_weights to false (hierarchical partitioning and "
                "quantized gradients still apply), or use a label count that divides evenly"
            )


def check_fsdp_wrap(strategy, model) -> None:
    """FSDP2: refuse a wrap list holding the input embedding's parent (accelerate shards the embedding alone)."""
    if not strategy.fsdp:
        return
    named = strategy.fsdp_wrap is not None
    names = list(strategy.fsdp_wrap) if named else list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    where = "the FSDP wrap list" if named else f"{type(model).__name__}._no_split_modules (accelerate's default)"
    if absent := [n for n in names if n not in present]:  # another family than the config's (ViT); timm's wrapper
        layers = [n for n in getattr(model, "_no_split_modules", None) or [] if n in present and "Embed" not in n]
        raise RecipeError(
            f"{where} names {', '.join(absent)}, which {type(model).__name__} does not have: wrap its "
            f"layer class ({', '.join(layers or repeated_blocks(model))}) with accelerate launch "
            "--fsdp_transformer_layer_cls_to_wrap, or fsdp_transformer_layer_cls_to_wrap in the accelerate config"
        )
    embed = getattr(model, "get_input_embeddings", lambda: None)()  # None: no module holds it, so nothing clashes
    holders = {type(m).__name__ for m in model.modules() if m is not model and any(c is embed for c in m.modules())}
    if clash := sorted(holders.intersection(names)):
        keep = [n for n in names if n not in holders]
        raise RecipeError(
            f"FSDP2 cannot wrap {', '.join(clash)} from {where}: it holds the input embedding that accelerate "
            f"shards on its own; wrap {','.join(keep) or 'the transformer layer class'} only "
            f"(fsdp_transformer_layer_cls_to_wrap in the accelerate config, as in accelerate_configs/fsdp.yaml)"
        )


def repeated_blocks(model) -> list[str]:
    """The class repeated most as a child (with children) of a Sequential/ModuleList: a model's block (timm's)."""
    lists = [m for m in model.modules() if type(m).__name__ in ("Sequential", "ModuleList")]
    found = Counter(type(c).__name__ for m in lists for c in m.children() if list(c.children()) and c not in lists)
    return [found.most_common(1)[0][0]] if found else ["see its modules"]


def _hub_id(name: str | None) -> bool:
    """A name the Hub must resolve: not a local path, nor one written as a path."""
    return bool(name) and not written_as_path(name) and not Path(name).expanduser().exists()


def _as_path(name: str) -> str | None:
    """`name` when it is more likely a missing local folder (one this repo builds, or its parent exists), else None."""
    local = name.rstrip("/") in LOCAL_BUILDERS or (name.count("/") == 1 and Path(name).parent.is_dir())
    return name if local else None


def check_hub(args) -> None:
    """Before any data or model: pushing is possible, and a model or dataset the Hub must give can be had."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

    check_push_ready(args.training)
    for flag, what in (
        ("model_name_or_path", "model"),
        ("config_name", "config"),
        ("image_processor_name", "image processor"),
    ):
        check_local_path(getattr(args.model, flag), what)  # an image processor not found was dropped without a word
    model, dataset = args.model, resolve_source(args.data.dataset_name)[0] if args.data.dataset_name else None
    if _hub_id(name := model.model_name_or_path):
        what = f"download the model '{name}'"
        reachable_or_cached(name, model.cache_dir, model.model_revision, what, missing=_as_path(name))
        try:  # the cached copy when there is one; offline without one, or unreachable, raises
            hf_hub_download(name, "config.json", revision=model.model_revision, cache_dir=model.cache_dir)
        except RemoteEntryNotFoundError:  # a repo without config.json (a LoRA adapter): modeling.py handles it
            pass
        except Exception as err:
            if offline_env():
                raise RecipeError(
                    f"model '{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: "
                    "pass a local checkpoint folder (--model_name_or_path ./checkpoint) or unset HF_HUB_OFFLINE"
                ) from None
            raise RecipeError(hub_error_message(err, what, missing=_as_path(name))) from None
    if _hub_id(dataset) and not (offline_env() or is_true(os.environ.get("HF_DATASETS_OFFLINE"))):
        try:  # offline, datasets reads its cache instead
            HfApi().dataset_info(dataset, timeout=20)
        except RepositoryNotFoundError:  # data.load_any names it with the offline hint
            pass
        except Exception as err:
            raise RecipeError(
                hub_error_message(err, f"download the dataset '{dataset}'", missing=_as_path(dataset))
            ) from None
