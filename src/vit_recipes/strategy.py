"""How a run is spread over processes (DDP, DeepSpeed ZeRO, FSDP2), checked before any work starts.

Four checks, each failing with one `RecipeError` line:

- `check_launch(argv)`, before the arguments are parsed: parsing builds `TrainingArguments`, which starts the
  process group, so more processes than GPUs must be caught before that;
- `check_strategy(args)`, right after parsing: the DeepSpeed file against the arguments, precision against the
  device, DeepSpeed and FSDP together, FSDP on CPU, offload against the host's free memory;
- `check_model(training_args, model)`, once the model is built: FSDP2's wrap list must not hold the
  input embedding (accelerate shards that on its own; torch fails obscurely otherwise), and ZeRO++'s quantized
  weights need shards DeepSpeed can quantize (the classifier's size depends on the label count);
- `check_resume(training_args, checkpoint)`, once the checkpoint to resume is known: a DeepSpeed checkpoint
  resumes only with the data-parallel world size that wrote it.

`RankReportCallback` (on when VIT_RECIPES_DEBUG_RANK_REPORT=1) makes every rank write what it actually ran with
into output_dir/rank_reports/rank{N}.json: world size, the wrapper the Trainer trained, ZeRO stage, and how many
parameter and optimizer-state elements this rank holds against the full model. Tests and benchmarks assert on
it, so a launcher that silently falls back to plain DDP (or to unconnected single processes) cannot pass.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from transformers import TrainerCallback

from .errors import RecipeError
from .fp8 import check_fp8

logger = logging.getLogger(__name__)

RANK_REPORT_ENV = "VIT_RECIPES_DEBUG_RANK_REPORT"
RANK_REPORT_DIR = "rank_reports"
AUTO = "auto"


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _is_true(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _env_int(*names: str, default: int = 1) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return default


# ------------------------------------------------------------------------------------------ what was asked for


@dataclass
class Strategy:
    """The strategy a run asks for, read from the arguments and what `accelerate launch` put in the environment."""

    deepspeed: dict | None  # the DeepSpeed config as written (with its "auto" values), or None
    deepspeed_source: str | None  # where it came from: a file name, or "--deepspeed"
    from_accelerate: bool  # DeepSpeed/FSDP configured by `accelerate launch` (env) rather than the arguments
    fsdp: bool
    fsdp_offload: bool
    fsdp_activation_checkpointing: bool

    @property
    def zero_stage(self) -> int | None:
        try:
            return int(self.deepspeed["zero_optimization"]["stage"])
        except (TypeError, KeyError, ValueError):
            return None

    def offload(self) -> tuple[bool, bool]:
        """(optimizer offloaded, parameters offloaded) to CPU or NVMe."""
        if self.fsdp:
            return self.fsdp_offload, self.fsdp_offload
        zero = (self.deepspeed or {}).get("zero_optimization", {}) or {}

        def off(key):
            return str((zero.get(key) or {}).get("device", "none")).lower() in ("cpu", "nvme")

        return off("offload_optimizer"), off("offload_param")

    @property
    def name(self) -> str:
        if self.deepspeed is not None:
            stage = self.zero_stage
            return "deepspeed" if stage is None else f"deepspeed-zero{stage}"
        return "fsdp" if self.fsdp else "ddp"


def load_deepspeed_config(value) -> tuple[dict, str]:
    """A DeepSpeed config given as a dict, a JSON file, a JSON string or base64 JSON, and a name for messages."""
    if isinstance(value, dict):
        return value, "the DeepSpeed config"
    text = str(value)
    path = Path(text)
    try:
        if path.is_file():
            return json.loads(path.read_text()), str(value)
        if text.lstrip().startswith("{"):
            return json.loads(text), "the DeepSpeed config"
        if text.endswith(".json"):
            raise RecipeError(f"DeepSpeed config file not found: {text} (paths are relative to where you launch)")
        return json.loads(base64.urlsafe_b64decode(text).decode()), "the DeepSpeed config"
    except (ValueError, UnicodeDecodeError) as err:
        raise RecipeError(f"{text} is not valid DeepSpeed JSON: {str(err).splitlines()[0]}") from None


def requested_strategy(training_args) -> Strategy:
    env = os.environ
    deepspeed, source, from_accelerate = None, None, False
    if getattr(training_args, "deepspeed", None):
        deepspeed, source = load_deepspeed_config(training_args.deepspeed)
    elif _is_true(env.get("ACCELERATE_USE_DEEPSPEED")):
        from_accelerate = True
        file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if file and file.lower() != "none":
            deepspeed, source = load_deepspeed_config(file)
        else:  # an accelerate YAML with inline deepspeed_config fields
            stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
            deepspeed = {
                "zero_optimization": {
                    "stage": int(stage) if stage.isdigit() else None,
                    "offload_optimizer": {"device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")},
                    "offload_param": {"device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")},
                }
            }
            source = "the accelerate config"
    fsdp_config = getattr(training_args, "fsdp_config", None) or {}
    fsdp_args = bool(getattr(training_args, "fsdp", None))
    fsdp_env = _is_true(env.get("ACCELERATE_USE_FSDP"))
    if fsdp_env and not fsdp_args:
        from_accelerate = True
    fsdp_offload = _is_true(fsdp_config.get("cpu_offload", False)) or (
        fsdp_env and _is_true(env.get("FSDP_OFFLOAD_PARAMS", "false"))
    )
    fsdp_ac = _is_true(fsdp_config.get("activation_checkpointing", False)) or (
        fsdp_env and _is_true(env.get("FSDP_ACTIVATION_CHECKPOINTING", "false"))
    )
    return Strategy(deepspeed, source, from_accelerate, fsdp_args or fsdp_env, fsdp_offload, fsdp_ac)


# ----------------------------------------------------------------------------------------- before parsing


def _recipe_value(argv: list[str], key: str):
    config = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            config = argv[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    if not config or not Path(config).is_file():
        return None
    try:
        values = yaml.safe_load(Path(config).read_text())
    except yaml.YAMLError:
        return None  # parse_args reports it
    return values.get(key) if isinstance(values, dict) else None


def _flag_value(argv: list[str], flag: str):
    """The value of a boolean flag on the command line (`--flag`, `--flag true`, `--flag=false`), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = _is_true(nxt) if nxt.lower() in ("true", "false", "1", "0", "yes", "no") else True
        elif arg.startswith(flag + "="):
            value = _is_true(arg.split("=", 1)[1])
    return value


def wants_cpu(argv: list[str]) -> bool:
    flag = _flag_value(argv, "--use_cpu")
    if flag is None:
        flag = _is_true(_recipe_value(argv, "use_cpu") or False)
    return flag or _is_true(os.environ.get("ACCELERATE_USE_CPU", "false"))


def check_launch(argv: list[str]) -> None:
    """Process count against GPUs, from the launcher's environment alone (before the process group starts)."""
    world = _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_WORLD_SIZE", default=world)
    if world <= 1 or wants_cpu(argv):
        return
    gpus = _visible_gpus()
    if gpus == 0:
        raise RecipeError(
            f"{world} processes were launched but this machine has no GPU: each would train alone on the CPU. "
            "Pass --use_cpu true to train on CPU processes (gloo), or launch on a machine with GPUs"
        )
    if local > gpus:
        raise RecipeError(
            f"{local} processes on this machine but only {gpus} GPU(s) visible: launch at most {gpus} "
            f"(--num_processes {gpus} with accelerate, --num_gpus {gpus} with deepspeed)"
        )


# ---------------------------------------------------------------------------------------- after parsing


def _precision(training_args) -> str:
    if training_args.fp16:
        return "fp16"
    if training_args.bf16:
        return "bf16"
    return str(getattr(training_args, "mixed_precision", "no") or "no").lower()


def _node(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return _is_true(a) == _is_true(b)
    try:
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return a == b


def deepspeed_conflicts(config: dict, training_args, world_size: int) -> list[str]:
    """Fixed (non-"auto") DeepSpeed values that disagree with the arguments, as 'key=value vs --flag value'."""
    t = training_args
    global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size
    checks = [
        ("train_micro_batch_size_per_gpu", t.per_device_train_batch_size, "--per_device_train_batch_size"),
        ("gradient_accumulation_steps", t.gradient_accumulation_steps, "--gradient_accumulation_steps"),
        (
            "train_batch_size",
            global_batch,
            f"the global batch (per-device {t.per_device_train_batch_size} x accumulation "
            f"{t.gradient_accumulation_steps} x {world_size} processes) =",
        ),
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
        fixed = _node(config, key)
        if fixed is None or fixed == AUTO:
            continue
        if not _same(fixed, value):
            shown = str(value).lower() if isinstance(value, bool) else value
            out.append(f"{key}={json.dumps(fixed)} vs {flag} {shown}")
    return out


def _gpu_bf16_ok() -> bool:
    import torch

    return not torch.cuda.is_available() or bool(torch.cuda.is_bf16_supported())  # only CUDA is checked


def _on_cpu(training_args) -> bool:
    """True when the run trains on CPU processes (asked for, or no accelerator at all)."""
    import torch

    if training_args.use_cpu or _is_true(os.environ.get("ACCELERATE_USE_CPU")):
        return True
    accelerators = (torch.cuda, getattr(torch.backends, "mps", None), getattr(torch, "xpu", None))
    return not any(a is not None and a.is_available() for a in accelerators)


def check_strategy(args) -> Strategy:
    """Reject, in one line each, strategy settings that would fail (or silently do something else) later.

    Also turns the Trainer's gradient checkpointing into FSDP's own when FSDP checkpoints activations (the
    Trainer refuses both at once; a recipe asking for checkpointing gets it either way).
    """
    t = args.training
    strategy = requested_strategy(t)
    world = max(1, int(getattr(t, "world_size", 1) or 1))
    cpu = _on_cpu(t)
    precision = _precision(t)

    if strategy.deepspeed is not None and strategy.fsdp:
        raise RecipeError(
            f"both DeepSpeed ({strategy.deepspeed_source}) and FSDP are configured: pick one (an accelerate FSDP "
            "config without --deepspeed, or a DeepSpeed config without --fsdp)"
        )
    if strategy.fsdp and cpu:
        raise RecipeError(
            "FSDP needs GPUs: on the CPU it does not shard (the Trainer falls back to DDP, accelerate starts "
            "unconnected processes); use accelerate_configs/ddp.yaml or a ds_configs/zero*.json on the CPU"
        )
    if precision == "fp16" and cpu:
        raise RecipeError(
            "fp16 needs a GPU and this run is on the CPU: drop --fp16 (CPU runs in fp32, or bf16 with --bf16 true)"
        )
    gpus = 0 if cpu else _visible_gpus()
    if world == 1 and strategy.deepspeed is None and not strategy.fsdp and gpus > 1:
        raise RecipeError(
            f"{gpus} GPUs are visible to one process: the Trainer would split each batch over them with "
            "torch.nn.DataParallel (seen 6x slower than one GPU on H200s); launch one process per GPU with "
            "`accelerate launch --multi_gpu` (or a config from accelerate_configs/), or pick one GPU with "
            "CUDA_VISIBLE_DEVICES=0"
        )
    if precision == "bf16" and not cpu and not _gpu_bf16_ok():
        raise RecipeError("bf16 is not supported by this GPU (it needs Ampere or newer): use --fp16 true instead")

    if strategy.deepspeed is not None:
        _check_deepspeed(strategy, t, world, precision)
    if strategy.fsdp and t.gradient_checkpointing:
        use_fsdp_activation_checkpointing(t, strategy)
    if any(strategy.offload()):
        check_host_memory(args, strategy, world)
    check_fp8(t, strategy, cpu)
    return strategy


def fsdp_wrap_classes(training_args, model) -> tuple[list[str], bool]:
    """The layer classes FSDP2 will wrap, and whether they were named (config/flag) or defaulted by accelerate."""
    named = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") if _is_true(os.environ.get("ACCELERATE_USE_FSDP")) else None
    named = named or (getattr(training_args, "fsdp_config", None) or {}).get("transformer_layer_cls_to_wrap")
    if named:
        names = named.split(",") if isinstance(named, str) else list(named)
        return [n.strip() for n in names if n.strip()], True
    return list(getattr(model, "_no_split_modules", None) or []), False


def check_fsdp_wrap(training_args, model) -> None:
    """FSDP2: refuse a wrap list that contains the input embedding's parent (e.g. ViTEmbeddings).

    accelerate shards `get_input_embeddings()` as a unit of its own after the wrap pass; if a wrapped class already
    holds it, its parameters are DTensors by then and torch fails deep inside fully_shard with "Invariant encountered:
    value was None" (seen with torch 2.11 and 2.13, accelerate 1.15, on ViT whose _no_split_modules names
    ViTEmbeddings). accelerate_configs/fsdp*.yaml therefore name the ViT layer class alone.
    """
    if not requested_strategy(training_args).fsdp:
        return
    names, named = fsdp_wrap_classes(training_args, model)
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    if embed is None:
        return
    holders = {
        type(module).__name__
        for module in model.modules()
        if module is not model and any(child is embed for child in module.modules())
    }
    clash = sorted(holders.intersection(names))
    if clash:
        keep = [n for n in names if n not in holders]
        where = "the FSDP wrap list" if named else f"{type(model).__name__}._no_split_modules (accelerate's default)"
        raise RecipeError(
            f"FSDP2 cannot wrap {', '.join(clash)} from {where}: it holds the input embedding that accelerate "
            f"shards on its own; wrap {','.join(keep) or 'the transformer layer class'} only "
            f"(fsdp_transformer_layer_cls_to_wrap in the accelerate config, as in accelerate_configs/fsdp.yaml)"
        )


def check_quantized_weights(training_args, model) -> None:
    """ZeRO++ quantized weights (qwZ): refuse a model whose parameter shards DeepSpeed cannot quantize.

    qwZ quantizes, per gathered module, the concatenation of its parameters' shards in groups of 8 values and
    asserts at the first forward that the count divides by 8 (seen on 4 H200s: the 100-label head's
    768 x 100 + 100 values split into 19,225 per GPU). The backbone's sizes are multiples of 64; the head's
    depend on the label count, so this is the check a user's dataset can trip. A ZeRO-3 leaf module is gathered
    as one unit with its children.
    """
    strategy = requested_strategy(training_args)
    if not _is_true(_node(strategy.deepspeed or {}, "zero_optimization.zero_quantized_weights")):
        return
    world = max(1, int(getattr(training_args, "world_size", 1) or 1))
    leaf_classes = set(_node(strategy.deepspeed, "zero_optimization.leaf_module.classes") or [])
    inside_leaf: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside_leaf:
            continue
        leaf = type(module).__name__ in leaf_classes
        if leaf:
            inside_leaf.update(id(m) for m in module.modules())
        params = list(module.parameters(recurse=leaf))
        shard = sum(-(-getattr(q, "ds_numel", q.numel()) // world) for q in params)
        if shard % 8:
            full = sum(getattr(q, "ds_numel", q.numel()) for q in params)
            raise RecipeError(
                f"{strategy.deepspeed_source}: ZeRO++ quantized weights need each gathered shard to hold a multiple "
                f"of 8 values, but {name or type(model).__name__}'s {full:,} parameters split into {shard:,} per "
                f"process over {world}: set zero_quantized_weights to false (hierarchical partitioning and "
                "quantized gradients still apply), or use a label count that divides evenly"
            )


def check_model(training_args, model) -> None:
    """The checks that need the built model: FSDP2's wrap list, ZeRO++'s quantized weights."""
    check_fsdp_wrap(training_args, model)
    check_quantized_weights(training_args, model)


def use_fsdp_activation_checkpointing(t, strategy: Strategy) -> None:
    """--gradient_checkpointing under FSDP: let FSDP checkpoint each wrapped layer instead of the model doing it.

    The Trainer refuses both at once, and FSDP's own checkpointing composes with resharding. The FSDP plugin is
    built later, by the Trainer, from the environment (accelerate launch) or from `fsdp_plugin_args` (--fsdp).
    """
    if not strategy.fsdp_activation_checkpointing:
        if strategy.from_accelerate:
            os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "true"
        elif isinstance(getattr(t, "fsdp_plugin_args", None), dict):
            t.fsdp_plugin_args["activation_checkpointing"] = True
        strategy.fsdp_activation_checkpointing = True
    logger.info("Gradient checkpointing runs as FSDP activation checkpointing (the model's own is switched off)")
    t.gradient_checkpointing = False
    if hasattr(t, "activation_checkpointing"):
        t.activation_checkpointing = False


def _check_deepspeed(strategy: Strategy, t, world: int, precision: str) -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise RecipeError(
            "DeepSpeed is not installed: pip install 'vit-recipes[deepspeed]' (on a CPU-only machine: "
            "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)"
        ) from None
    name = strategy.deepspeed_source
    if strategy.from_accelerate and _is_true(os.environ.get("ACCELERATE_USE_CPU")):
        raise RecipeError(
            "DeepSpeed cannot run with accelerate's use_cpu/--cpu (accelerate then skips DeepSpeed's setup): "
            "keep use_cpu: false in the accelerate config and pass --use_cpu true to the script instead"
        )
    if strategy.from_accelerate and precision in ("fp16", "bf16") and not (t.fp16 or t.bf16):
        raise RecipeError(
            f"accelerate --mixed_precision {precision} without --{precision} true: under DeepSpeed the Trainer "
            f"would stop at its first step (bf16/fp16 mismatch); pass --{precision} true to the script instead"
        )
    conflicts = deepspeed_conflicts(strategy.deepspeed, t, world)
    if conflicts:
        raise RecipeError(
            f'{name} conflicts with the arguments: {"; ".join(conflicts)}. Set these to "auto" in the JSON '
            "so the arguments decide, or change the arguments to match"
        )
    if strategy.zero_stage == 3 and getattr(t, "torch_compile_regions", False):
        raise RecipeError(
            f"{name}: --torch_compile_regions does not train correctly under ZeRO-3 (on 2 H200s ViT-B's loss after "
            "60 steps was 1.98 against 1.31 eager) and was slower there: drop it, or use ZeRO-2 or FSDP2 with it"
        )
    hpz = _node(strategy.deepspeed, "zero_optimization.zero_hpz_partition_size")
    if isinstance(hpz, int) and hpz > 1 and world % hpz:
        raise RecipeError(
            f"{name}: zero_hpz_partition_size {hpz} does not divide the {world} processes: set it to the number "
            "of GPUs per node"
        )
    _bind_deepspeed_comm()


def _bind_deepspeed_comm() -> None:
    """Let DeepSpeed use the process group the arguments started (gloo with --use_cpu).

    On GPUs accelerate starts DeepSpeed's communication itself. On CPU processes it starts plain torch.distributed,
    and ZeRO-3's deepspeed.zero.Init (used while the model loads, before the Trainer initialises DeepSpeed) would
    then count a world size of 1 and fail its batch-size check.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def check_host_memory(args, strategy: Strategy, world: int) -> None:
    """Offloading keeps optimizer states (and maybe parameters) in host RAM: refuse when it cannot fit."""
    import psutil

    from .advise import host_memory_for, model_shape_from_args

    shape = model_shape_from_args(args.model)
    if shape is None:  # no config to read yet (e.g. an uncached Hub id): build_model reports that
        return
    local = _env_int("LOCAL_WORLD_SIZE", default=world)
    nodes = max(1, world // max(1, local))
    needed = host_memory_for(strategy, shape, gpus_per_node=local, nodes=nodes)
    available = psutil.virtual_memory().available
    if needed > available:
        raise RecipeError(
            f"{strategy.name} offload needs about {needed / 2**30:.1f} GiB of host memory on this node for "
            f"{shape.params / 1e6:.0f}M parameters but {available / 2**30:.1f} GiB is available: use a "
            "configuration without offload, more nodes, or a machine with more memory "
            "(python -m vit_recipes.advise shows the options)"
        )


# ------------------------------------------------------------------------------------------------- resume

_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def deepspeed_checkpoint_world_size(checkpoint: str | os.PathLike) -> int | None:
    """Data-parallel world size a DeepSpeed checkpoint was written with (one optimizer shard per rank)."""
    folder = Path(checkpoint)
    tag_file = folder / "latest"
    tags = [tag_file.read_text().strip()] if tag_file.is_file() else []
    tags += [p.name for p in sorted(folder.glob("global_step*")) if p.is_dir()]
    for tag in tags:
        ranks = {int(m.group(1)) for f in glob.glob(str(folder / tag / "*")) if (m := _OPTIM_FILE.search(f))}
        if ranks:
            return max(ranks) + 1
    return None


def check_resume(training_args, checkpoint: str | None) -> None:
    """A DeepSpeed checkpoint resumes only under DeepSpeed and with the world size that wrote it."""
    if not checkpoint:
        return
    strategy = requested_strategy(training_args)
    saved = deepspeed_checkpoint_world_size(checkpoint)
    world = max(1, int(getattr(training_args, "world_size", 1) or 1))
    if saved is not None and strategy.deepspeed is None:
        raise RecipeError(
            f"{checkpoint} is a DeepSpeed checkpoint ({saved} processes): resume it with the same DeepSpeed "
            "config and process count, or start a fresh run in another --output_dir"
        )
    if saved is None and strategy.deepspeed is not None and (Path(checkpoint) / "trainer_state.json").is_file():
        raise RecipeError(
            f"{checkpoint} was not written by DeepSpeed: resume it with the strategy that wrote it, or start a "
            "fresh run in another --output_dir"
        )
    if saved is not None and saved != world:
        raise RecipeError(
            f"{checkpoint} was written by {saved} DeepSpeed processes and this run has {world}: ZeRO shards "
            f"cannot be re-split on resume. Launch {saved} processes, or convert it first with "
            f"`python {checkpoint}/zero_to_fp32.py` and fine-tune from the result in a new --output_dir"
        )


# -------------------------------------------------------------------------------------------- rank report


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


def rank_report(trainer) -> dict[str, Any]:
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
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "fsdp_activation_checkpointing": any(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules()),
        "precision": _precision(trainer.args),
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

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        report = rank_report(self.trainer)
        report["global_step"] = state.global_step
        folder = Path(args.output_dir) / RANK_REPORT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=2) + "\n")


def rank_report_enabled() -> bool:
    return _is_true(os.environ.get(RANK_REPORT_ENV, "0"))


def attach_rank_report(trainer) -> None:
    """Add `RankReportCallback` when VIT_RECIPES_DEBUG_RANK_REPORT=1 (tests, benchmarks)."""
    if rank_report_enabled():
        trainer.add_callback(RankReportCallback(trainer))


# ------------------------------------------------------------------------------------- ZeRO-3 model loading


def zero3_enabled() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def model_class_for(config):
    """The image-classification class for a config (what AutoModelForImageClassification would pick)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING

    return MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(config)]


def zero3_state_dict_for_new_head(source: str, config, revision: str = "main", cache_dir: str | None = None):
    """The checkpoint's tensors minus those whose shape changes (the new classification head), or None.

    Under ZeRO-3, `from_pretrained` loads through deepspeed.zero.Init and ignores `ignore_mismatched_sizes`: a
    checkpoint whose head has another number of classes fails with a size mismatch. Passing the checkpoint without
    those tensors as `state_dict` loads the rest and initialises the head like any missing weight. Like
    transformers itself, only rank 0 reads values; the other ranks get meta tensors of the right shapes.
    """
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

    def resolve(name):
        return cached_file(
            source, name, revision=revision, cache_dir=cache_dir, _raise_exceptions_for_missing_entries=False
        )

    files = []
    if single := resolve(SAFE_WEIGHTS_NAME):
        files = [single]
    elif index := resolve(SAFE_WEIGHTS_INDEX_NAME):
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        files = [resolve(shard) for shard in shards]
    if not files or not all(files):
        return None  # .bin checkpoints: leave it to transformers
    if type(config) not in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING:
        return None
    model_class = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(config)]
    with init_empty_weights():
        expected = {k: tuple(v.shape) for k, v in model_class(config).state_dict().items()}
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    state_dict, dropped = {}, []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                piece = f.get_slice(key)
                shape = tuple(piece.get_shape())
                if key in expected and expected[key] != shape:
                    dropped.append(key)
                    continue
                if rank0:
                    state_dict[key] = f.get_tensor(key)
                else:
                    dtype = getattr(
                        torch,
                        {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(piece.get_dtype(), "float32"),
                    )
                    state_dict[key] = torch.empty(shape, dtype=dtype, device="meta")
    if not dropped:
        return None
    logger.info("ZeRO-3: loading %s without %s (new head)", source, ", ".join(dropped))
    return state_dict


SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"  # DeepSpeed's shm comm op (csrc/cpu/comm/shm.cpp)


def remove_shm_buffer_at_exit() -> None:
    """Have this rank delete DeepSpeed's CPU all-reduce buffer when the process exits.

    DeepSpeed's shared-memory all-reduce (the shm comm op `make install` builds for CPU runs) creates one 69 MB file
    per rank, `/dev/shm/deepspeed_allreduce_buffer_<n>_<addr>_<port>_<rank>`, and never unlinks it: each CPU
    DeepSpeed run left 138 MB behind until reboot (seen: 22 GB after a day of test runs, then the OOM killer).
    Unlinking at exit is safe: ranks that mapped the buffer keep their mapping.
    """
    rank, port = os.environ.get("RANK"), os.environ.get("MASTER_PORT")
    if rank is None or port is None:
        return
    pattern = f"{SHM_BUFFER_PREFIX}*_{port}_{rank}"

    def remove() -> None:
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):  # already gone, or another user's file: nothing to do
                os.unlink(path)

    atexit.register(remove)


def shutdown() -> None:
    """Tear the process group down once every rank is done (torch asks for it; NCCL may hang at exit without it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
