"""The run's strategy, precision, batch, device and output dir: derived once (`build_plan`), applied (`configure`)."""

import base64
import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.arguments import RunArguments, compile_cache_dir, compile_regions, run_config, set_checkpointing
from ..core.errors import RecipeError, first_line
from ..core.launch import bind_deepspeed_comm, env_int, is_true, launch_notes
from ..model.facts import ModelFacts, read_model_facts
from ..model.lora import is_adapter_dir
from ..model.modeling import training_image_size
from . import strategies
from .checks import check_plan, config_value, deepspeed_checkpoint_world_size, turned_on
from .memory import PREFERENCE, estimate, gib, model_shape
from .run_dir import OutputState, lock_output_dir, remove_checkpoints, resolve_output_dir, to_universal

logger = logging.getLogger(__name__)
OFFLOADS = ("offload_optimizer", "offload_param")  # DeepSpeed's zero_optimization sections
# The estimate ran up to 15% under measured peaks (ViT-H, DDP): a batch fits within this share of memory.
FITS_WITHIN = 0.8
# A regional compile costs what ~1000 steps save cold, ~400 warm (docs/benchmarks.md, "When compilation pays").
COMPILE_PAYS_AFTER_STEPS = 1000
COMPILE_PAYS_AFTER_STEPS_WARM = 400
COMPILED_RECORD = "vit_recipes_compiled.json"  # in the compile cache: the runs whose artifacts it holds
# torch.compile's mode for CUDA graphs: each compiled layer's kernels launched as one graph. A compiled step at the
# recipe's batch waits on the host's launches, not the GPU (docs/benchmarks.md, "The bare step against the
# recipe's"); graphs remove the wait.
CUDA_GRAPHS = "reduce-overhead"


def load_deepspeed_config(value) -> tuple[dict, str]:
    """A DeepSpeed config given as a dict, a JSON file, a JSON string or base64 JSON, and a name for messages."""
    if isinstance(value, dict):
        return value, "the DeepSpeed config"
    text = str(value)
    try:
        if (path := Path(text)).is_file():
            return json.loads(path.read_text()), text
        inline = text.lstrip().startswith("{")
        if text.endswith(".json") and not inline:
            raise RecipeError(f"DeepSpeed config file not found: {text} (paths are relative to where you launch)")
        return json.loads(text if inline else base64.urlsafe_b64decode(text).decode()), "the DeepSpeed config"
    except (ValueError, UnicodeDecodeError) as err:
        raise RecipeError(f"{text} is not valid DeepSpeed JSON: {first_line(err)}") from None


@dataclass(frozen=True)
class Strategy:
    """How the run is spread over processes: its row in the strategy table and the settings behind it."""

    spec: strategies.StrategySpec  # the table row (name, configs, what is sharded, what is supported)
    world_size: int  # processes in the run, over all machines
    processes_per_node: int
    deepspeed_config: dict | None  # as written ("auto" values included), parsed once; None without DeepSpeed
    deepspeed_source: str | None  # where that config came from, for messages: a file or "the accelerate config"
    from_accelerate: bool  # DeepSpeed/FSDP configured by `accelerate launch` (environment), not by the arguments
    fsdp: bool  # configured by the arguments or by accelerate
    fsdp_activation_checkpointing: bool  # asked for, or --gradient_checkpointing under FSDP
    fsdp_wrap: tuple[str, ...] | None  # layer classes to wrap (None: accelerate's default, _no_split_modules)
    offload_optimizer: bool  # optimizer states live in host memory
    offload_params: bool  # parameters live in host memory
    autocast: bool  # DeepSpeed's torch_autocast (fp32 weights, as under DDP), not its bf16/fp16 mode (16-bit weights)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def zero_stage(self) -> int | None:
        return self.spec.zero_stage

    @property
    def deepspeed(self) -> bool:
        return self.deepspeed_config is not None

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.processes_per_node))


def read_strategy(training_args) -> Strategy:
    """The strategy a run asks for, from the arguments and what `accelerate launch` put in the environment."""
    env = os.environ
    world = max(1, int(getattr(training_args, "world_size", 1) or 1))
    deepspeed, source, from_accelerate = None, None, False
    if getattr(training_args, "deepspeed", None):
        deepspeed, source = load_deepspeed_config(training_args.deepspeed)
    elif is_true(env.get("ACCELERATE_USE_DEEPSPEED")):
        from_accelerate = True
        if (file := env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")) and file.lower() != "none":
            deepspeed, source = load_deepspeed_config(file)
        else:  # an accelerate YAML with inline deepspeed_config fields
            stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
            zero = {key: {"device": env.get(f"ACCELERATE_DEEPSPEED_{key.upper()}_DEVICE", "none")} for key in OFFLOADS}
            deepspeed = {"zero_optimization": {"stage": int(stage) if stage.isdigit() else None, **zero}}
            source = "the accelerate config"
    fsdp_config = getattr(training_args, "fsdp_config", None) or {}
    fsdp_args, fsdp_env = bool(getattr(training_args, "fsdp", None)), is_true(env.get("ACCELERATE_USE_FSDP"))
    fsdp = fsdp_args or fsdp_env

    def fsdp_option(key: str, env_key: str) -> bool:  # set in the arguments' fsdp_config, or by accelerate launch
        return fsdp and (is_true(fsdp_config.get(key, False)) or (fsdp_env and is_true(env.get(env_key))))

    offload_optimizer = offload_params = fsdp_option("cpu_offload", "FSDP_OFFLOAD_PARAMS")
    if deepspeed is not None:
        offload_optimizer, offload_params = (
            str(config_value(deepspeed, f"zero_optimization.{key}.device") or "none").lower() in ("cpu", "nvme")
            for key in OFFLOADS
        )
    wrap = (fsdp_env and env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")) or fsdp_config.get("transformer_layer_cls_to_wrap")
    if isinstance(wrap, str):
        wrap = wrap.split(",")
    try:
        stage = int(config_value(deepspeed, "zero_optimization.stage"))
    except (TypeError, ValueError):
        stage = None if deepspeed is None else 0
    quantized = ("zero_quantized_weights", "zero_quantized_gradients")
    hpz = config_value(deepspeed, "zero_optimization.zero_hpz_partition_size") or 1
    zeropp = any(is_true(config_value(deepspeed, f"zero_optimization.{key}")) for key in quantized) or hpz > 1
    return Strategy(
        spec=strategies.identify(stage, fsdp, offload_optimizer, zeropp, world), world_size=world,
        processes_per_node=env_int("LOCAL_WORLD_SIZE", default=world), deepspeed_config=deepspeed,
        deepspeed_source=source, from_accelerate=from_accelerate or (fsdp_env and not fsdp_args), fsdp=fsdp,
        fsdp_activation_checkpointing=fsdp_option("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING")
        or (fsdp and bool(getattr(training_args, "gradient_checkpointing", False))),
        fsdp_wrap=tuple(n.strip() for n in wrap if n.strip()) if wrap else None, offload_optimizer=offload_optimizer,
        offload_params=offload_params, autocast=turned_on(deepspeed, "torch_autocast"),
    )  # fmt: skip


def device_kind(training_args) -> str:
    import torch

    if training_args.use_cpu or is_true(os.environ.get("ACCELERATE_USE_CPU")):
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu"


def precision_of(training_args) -> str:
    if training_args.fp16 or training_args.bf16:
        return "fp16" if training_args.fp16 else "bf16"
    launched = str(getattr(training_args, "mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION", ""))
    return launched.lower() if launched.lower() in ("bf16", "fp16") else "fp32"


@dataclass(frozen=True)
class RunPlan:
    """What a run is, derived once from its arguments and launch environment."""

    strategy: Strategy
    precision: str  # "bf16", "fp16" or "fp32"
    device: str  # "cuda", "mps", "xpu" or "cpu"
    global_batch: int  # images per optimizer step: per-device batch x accumulation x world size
    output: OutputState  # a fresh start, a run to resume (from which checkpoint), an overwrite, or a refusal
    identity: dict[str, Any]  # the settings that make this run this run (run_config.json)
    model: ModelFacts  # the model's config, classifier class, processor size: read here once, passed on

    @property
    def resume_from(self) -> str | None:
        return self.output.resume_from


def build_plan(args: RunArguments) -> RunPlan:
    """Derive the plan from parsed arguments and refuse, in one line, anything that could only fail later."""
    t = args.training
    strategy, precision, device = read_strategy(t), precision_of(t), device_kind(t)
    facts = read_model_facts(args.model, labels=not args.data.dataset_name)  # the run's one read of the config
    if device == "cuda":
        strategy = advise_memory(args, strategy, precision, facts)
    elif t.checkpointing_by_memory:
        logger.info(
            "Gradient checkpointing off (no GPU memory to estimate; --gradient_checkpointing true turns it on)"
        )
    global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * strategy.world_size
    # A checkpoint written under other settings is refused on auto-resume; one process and DDP resume each other.
    kind = "ddp or single" if strategy.name in ("ddp", "single") else strategy.name
    identity = {**run_config(args), "strategy": kind, "global_batch": global_batch, "recipe": args.recipe}
    plan = RunPlan(strategy, precision, device, global_batch, resolve_output_dir(t, identity), identity, facts)
    check_plan(plan, args)
    spec, resumed = strategy.spec, f" from {plan.resume_from}" if plan.resume_from else ""
    half = strategy.deepspeed and precision != "fp32"  # DeepSpeed's two 16-bit modes: docs/distributed.md
    weights = " (DeepSpeed's torch_autocast, fp32 weights)" if strategy.autocast else " (16-bit weights)"
    logger.info(
        f"Plan: {spec.label} on {strategy.world_size} process(es) (sharded: {spec.shards}), {plan.precision}"
        f"{weights if half else ''} on {plan.device}, global batch {global_batch}, output dir {plan.output.state}"
        f"{resumed}"
    )
    for note in launch_notes(global_batch) if t.process_index == 0 else ():
        logger.warning(note)
    if half and not strategy.autocast and t.process_index == 0:
        logger.warning(
            f"{strategy.deepspeed_source} trains in DeepSpeed's {precision} mode: {precision} weights, which learn "
            "more slowly than DDP's fp32 ones while the learning rate is small (ViT-H: +15% mean loss over the first "
            "30 warm-up steps); the shipped ZeRO-1/2/3 configs autocast over fp32 weights instead (docs/distributed.md)"
        )
    return plan


def advise_memory(args: RunArguments, strategy: Strategy, precision: str, facts: ModelFacts) -> Strategy:
    """Checkpointing, where unset, on only if the batch won't fit without it; one line if a lighter strategy fits."""
    import torch

    t, batch = args.training, args.training.per_device_train_batch_size
    # This run's row (one process as DDP) and those of the strategies that communicate less
    rows = PREFERENCE[: PREFERENCE.index(strategy.name) + 1] if strategy.name in PREFERENCE else ("ddp",)
    if not torch.cuda.is_available() or (len(rows) == 1 and not t.checkpointing_by_memory):
        return strategy  # no GPU to measure (a CUDA plan in tests), or nothing to decide or suggest
    gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    budget, world = FITS_WITHIN * gpu, strategy.world_size
    try:  # full fine-tuning's states: an upper bound for LoRA and head-only runs
        # the tokens of the size it trains at (DINOv2: its processor's 224, not its config's 518; modeling.py)
        shape = replace(model_shape(facts.fresh_config()), image_size=training_image_size(facts, say=False))
        by_name = {e.strategy.name: e for e in estimate(shape, world, batch, strategy.nodes, precision, keys=rows)}
    except (RecipeError, OSError, ValueError, AttributeError, KeyError) as err:  # not ViT-shaped, or not readable yet
        if t.checkpointing_by_memory:
            logger.info("Gradient checkpointing off: no memory estimate for this model (%s)", first_line(err, 160))
        return strategy
    mine = by_name[rows[-1]]
    if t.checkpointing_by_memory:
        on = mine.total > budget
        set_checkpointing(t, on)
        (logger.warning if on else logger.info)(  # on changes the run (slower steps); off is what it would be
            f"Gradient checkpointing {'on' if on else 'off'}: batch {batch} needs about {gib(mine.total)} GiB per GPU "
            f"without it ({strategy.spec.label}), {'over' if on else 'within'} {FITS_WITHIN:.0%} of this GPU's "
            f"{gib(gpu)} GiB{f'; {gib(mine.total_ckpt)} GiB with it' if on else ''}; --gradient_checkpointing "
            f"{'false' if on else 'true'} overrides"
        )
        if on and strategy.fsdp:
            strategy = replace(strategy, fsdp_activation_checkpointing=True)
    if strategy.name not in PREFERENCE:  # one process: nothing to communicate
        return strategy
    need = "total_ckpt" if t.gradient_checkpointing else "total"
    lighter = (by_name[n] for n in PREFERENCE[: PREFERENCE.index(strategy.name)])
    if fitting := next((e for e in lighter if getattr(e, need) <= budget), None):
        logger.warning(
            f"{strategy.spec.label} shards what fits whole: {fitting.strategy.label}, which communicates less, fits "
            f"these GPUs too (about {gib(getattr(fitting, need))} of {gib(gpu)} GiB per GPU at batch {batch}) and is "
            f"usually faster: launch with {fitting.strategy.accelerate_config} (docs/distributed.md, 'Which "
            "strategy', has measured speeds)"
        )
    return strategy


def eager_if_compile_fails() -> None:
    """What torch.compile cannot compile runs eagerly, said in one warning, not a traceback per frame."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    said = []

    def one_line(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("WON'T CONVERT"):
            return True
        if not said:
            lines = [line.strip() for line in message.splitlines() if line.strip()]
            said.append(next((line for line in reversed(lines) if "Error" in line), lines[-1]))
            logger.warning("torch.compile failed, so this part trains eagerly (slower, same results): %s", said[0])
        return False

    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    for old in [f for f in dynamo_log.filters if getattr(f, "__name__", "") == "one_line"]:
        dynamo_log.removeFilter(old)  # an earlier run's, in this process
    dynamo_log.addFilter(one_line)


def planned_steps(t, train_images: int, global_batch: int) -> int:
    """Optimizer steps the run will take (drop_last, as compiled runs drop each epoch's short batch)."""
    return t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * max(1, train_images // global_batch))


def decide_compile(plan: RunPlan, args: RunArguments, steps: int, model) -> str | None:
    """Regional compilation, where unset, on if the run repays the compile; the key to remember, None if eager."""
    t, key = args.training, None
    if not (t.do_train and plan.device == "cuda") or t.torch_compile_regions is False:
        return None
    if t.torch_compile_regions is None and not t.torch_compile:  # --torch_compile alone: the whole model, as asked
        if t.fp8 and t.fp8_backend == "transformer_engine":
            logger.warning("Regional compilation off: Transformer Engine's FP8 layers run eagerly")
            return None
        if not plan.strategy.spec.supports("torch_compile_regions"):  # where it does not train correctly (ZeRO-3)
            return None
        key = compile_key(plan, args, model) if steps >= COMPILE_PAYS_AFTER_STEPS_WARM else None  # short: no need
        warm = key is not None and was_compiled(plan, key)
        if steps < (COMPILE_PAYS_AFTER_STEPS_WARM if warm else COMPILE_PAYS_AFTER_STEPS):
            logger.warning(
                "Regional compilation off: %s steps would not repay the compile (it pays from %s steps, or %s where "
                "the compile cache holds this model and batch; --torch_compile_regions true compiles anyway)",
                f"{steps:,}", f"{COMPILE_PAYS_AFTER_STEPS:,}", COMPILE_PAYS_AFTER_STEPS_WARM,
            )  # fmt: skip
            return None
        why = f"{steps:,} steps repay it" + (f" from the compile cache ({compile_cache_dir()})" if warm else "")
        compile_regions(t, after_init=True)
        eager_if_compile_fails()
        logger.warning(f"Regional compilation on: {why} (--torch_compile_regions false trains eagerly)")
    if not t.torch_compile_regions:
        return None
    if t.torch_compile_mode is None and (mode := compile_mode(plan, t)):
        t.torch_compile_mode = mode
        logger.warning(
            "CUDA graphs on: each compiled layer launches its kernels as one graph (--torch_compile_mode %s), as the "
            "step waits on the host's launches (--torch_compile_regions true --torch_compile_mode default compiles "
            "without them)",
            mode,
        )
    return key or compile_key(plan, args, model)


def compile_mode(plan: RunPlan, t) -> str | None:
    """torch.compile's mode for this run's regions: the one asked for, else CUDA graphs where they are known to train
    as eager does (one process on a GPU, every layer's forward once a step), else torch's default (None).
    Not under DDP, DeepSpeed or FSDP (their hooks and collectives run between the layers; untested with graphs),
    gradient checkpointing (it runs a layer's forward again inside the backward) or --fp8 (untested)."""
    if t.torch_compile_mode is not None:
        return t.torch_compile_mode
    eligible = plan.device == "cuda" and plan.strategy.name == "single"
    return CUDA_GRAPHS if eligible and not (t.gradient_checkpointing or t.fp8) else None


def compile_key(plan: RunPlan, args: RunArguments, model) -> str:
    """A digest of compiled artifacts' inputs; a wrong match costs a cold compile (Inductor keys by graph)."""
    import hashlib
    from importlib.metadata import distributions

    import torch

    triton_version = next((d.version for d in distributions(name="triton")), None)  # without importing Triton
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("id2label", "label2id", "_name_or_path")}
    t = args.training
    parts = [torch.__version__, triton_version, torch.cuda.get_device_name(), repr(model), config,
             t.per_device_train_batch_size, t.per_device_eval_batch_size, plan.precision,
             t.tf32, bool(t.gradient_checkpointing), plan.strategy.name, args.augment.patch_dropout,
             model.config._attn_implementation, compile_mode(plan, t)]  # fmt: skip  # to_dict() leaves the attention out
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _compiled_keys() -> dict:
    with contextlib.suppress(OSError, ValueError):  # none yet, or unreadable: no key is warm
        keys = json.loads(Path(compile_cache_dir(), COMPILED_RECORD).read_text())
        return keys if isinstance(keys, dict) else {}
    return {}


def was_compiled(plan: RunPlan, key: str) -> bool:
    """Whether the compile cache holds this key's artifacts; one machine only, where all processes read one file."""
    disabled = is_true(os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES"))
    return plan.strategy.world_size == plan.strategy.processes_per_node and not disabled and key in _compiled_keys()


def remember_compiled(key: str | None) -> None:
    """Record that the compile cache holds a compiled run's artifacts (the 50 newest kept)."""
    if not key:
        return
    keys = {k: v for k, v in _compiled_keys().items() if k != key}
    keys = dict(list(keys.items())[-49:]) | {key: time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = Path(compile_cache_dir(), COMPILED_RECORD)
    with contextlib.suppress(OSError):  # a read-only cache: later runs decide by steps alone
        path.parent.mkdir(parents=True, exist_ok=True)
        mine = path.with_suffix(f".{os.getpid()}.tmp")
        mine.write_text(json.dumps(keys, indent=1))
        mine.replace(path)  # whole or not at all: runs sharing a cache may read or write it meanwhile


def warn_if_warmup_outlasts_the_run(t, steps: int) -> None:
    """One line when the warm-up is as long as the run: the learning rate never reaches --learning_rate."""
    warmup = t.get_warmup_steps(steps) if steps else 0
    if t.do_train and warmup >= steps > 0:
        logger.warning(
            f"The warm-up ({warmup:,} steps) is as long as the run ({steps:,} steps): the learning rate peaks at "
            f"{t.learning_rate * steps / warmup:.3g}, not --learning_rate {t.learning_rate:g}; lower --warmup_steps "
            "(e.g. to a tenth of the steps) for a full schedule"
        )


def configure(plan: RunPlan, args: RunArguments) -> None:
    """Apply what the plan decided to the settings accelerate, the Trainer and DeepSpeed read later."""
    t, strategy = args.training, plan.strategy
    if t.process_index == 0:  # locked before anything is removed or written there
        lock_output_dir(t.output_dir)
        remove_checkpoints(plan.output.stale_checkpoints)  # a new run must never resume the old run's state
    if plan.device == "cpu":  # no accelerator to pin memory for (torch warns at every DataLoader otherwise)
        t.dataloader_pin_memory = False
        t.accelerator_config.non_blocking = False  # nothing to copy to (the Trainer warns without pinned memory)
    frozen_backbone = args.lora.method != "full" or is_adapter_dir(args.model.model_name_or_path)
    if frozen_backbone and t.ddp_find_unused_parameters is None:
        # Every trainable parameter is used each step; True costs a graph walk per step, breaks reentrant checkpointing
        t.ddp_find_unused_parameters = False
    if strategy.fsdp and t.gradient_checkpointing:
        # The Trainer refuses its own checkpointing with FSDP: use FSDP's (its plugin is built later, from these)
        if strategy.from_accelerate:
            os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "true"
        elif isinstance(getattr(t, "fsdp_plugin_args", None), dict):
            t.fsdp_plugin_args["activation_checkpointing"] = True
        logger.info("Gradient checkpointing runs as FSDP activation checkpointing (the model's own is switched off)")
        set_checkpointing(t, False)
    if strategy.deepspeed:
        bind_deepspeed_comm()
    if strategy.autocast:  # torch_autocast over fp32 weights, as DDP: fill its "auto" fields; the Trainer's bf16 off
        config = t.deepspeed_plugin.deepspeed_config  # the dict DeepSpeed receives, under either launcher
        section = config["torch_autocast"]
        if section.get("enabled") == "auto":
            section["enabled"] = plan.precision != "fp32"
        if section.get("dtype", "auto") == "auto":
            section["dtype"] = "bfloat16"  # fp16 is refused with torch_autocast (checks.py)
        for mode in ("bf16", "fp16"):  # accelerate's plugin set these from --bf16/--fp16 at parsing
            if isinstance(config.get(mode), dict):
                config[mode]["enabled"] = False
        t.bf16 = t.fp16 = False
        t.mixed_precision = "no"  # what the Trainer hands to accelerate
        if getattr(t.deepspeed_plugin, "dschf", None) is not None:  # accelerate's copy, read by ZeRO-3's model init
            t.deepspeed_plugin.set_deepspeed_weakref()
    if t.torch_compile:  # asked for; unset, decide_compile chooses once the number of steps is known
        eager_if_compile_fails()
    saved = plan.resume_from and strategy.deepspeed and deepspeed_checkpoint_world_size(plan.resume_from)
    if saved and saved != strategy.world_size:
        logger.warning(
            f"{plan.resume_from} was written by {saved} DeepSpeed processes and this run has {strategy.world_size}: "
            "resuming it through DeepSpeed's universal checkpoint, converted once into that folder"
        )
        with t.main_process_first(local=False, desc="the universal checkpoint"):
            if t.process_index == 0:
                to_universal(plan.resume_from)
