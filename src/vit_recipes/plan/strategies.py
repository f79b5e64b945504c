"""The one table of distributed strategies, whose names all code and docs use. Pure data: it imports nothing."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StrategySpec:
    """One strategy: how to launch it and what it can do."""

    name: str  # the key everywhere: plans, benchmark records, reports, the model card's tag
    label: str  # how people write it (tables, messages)
    accelerate_config: str | None  # `accelerate launch --config_file` file (None: plain `python`/`torchrun`)
    deepspeed_config: str | None  # `deepspeed ... --deepspeed` file (None: not a DeepSpeed strategy)
    zero_stage: int | None  # DeepSpeed ZeRO stage (None: not DeepSpeed)
    shards: str  # what each process holds only a shard of
    offload: bool = False  # optimizer states (and, for stage 3 and FSDP2, parameters) live in host memory
    # Features refused, each with its one-line reason (keys: `lora`, `torch_compile_regions`, `fp8`, `ema`).
    refusals: dict[str, str] = field(default_factory=dict)

    def supports(self, feature: str) -> bool:
        return feature not in self.refusals


_ALL, _GRADS = "parameters, gradients and optimizer states", "optimizer states and gradients"
_ROWS = (  # name, label, accelerate config, DeepSpeed JSON (under accelerate_configs/, ds_configs/), stage, shards
    ("single", "one device", None, None, None, "nothing"),
    ("ddp", "DDP", "ddp.yaml", None, None, "nothing (every process holds the whole model)"),
    ("zero1", "ZeRO-1", "zero1.yaml", "zero1.json", 1, "optimizer states"),
    ("zero2", "ZeRO-2", "zero2.yaml", "zero2.json", 2, _GRADS),
    ("zero2_offload", "ZeRO-2 + offload", "zero2_offload.yaml", "zero2_offload.json", 2, _GRADS),
    ("zero3", "ZeRO-3", "zero3.yaml", "zero3.json", 3, _ALL),
    ("zeropp", "ZeRO++", "zeropp.yaml", "zeropp.json", 3, _ALL + " (plus a secondary copy per node)"),
    ("zero3_offload", "ZeRO-3 + offload", "zero3_offload.yaml", "zero3_offload.json", 3, _ALL),
    ("fsdp2", "FSDP2", "fsdp.yaml", None, None, _ALL),
    ("fsdp2_offload", "FSDP2 + offload", "fsdp_offload.yaml", None, None, _ALL),
)


def _spec(name, label, accelerate, deepspeed, stage, shards) -> StrategySpec:
    refusals = {}
    if name not in ("single", "ddp"):
        refusals["fp8"] = (
            f"--fp8 runs on one GPU or under DDP; with {label} it is untested (sharding splits the float8 layers' "
            "weights): drop --fp8 or use accelerate_configs/ddp.yaml"
        )
    if stage == 3:
        refusals["torch_compile_regions"] = (
            "--torch_compile_regions does not train correctly under ZeRO-3 (on 2 H200s ViT-B's loss after 60 steps "
            "was 1.98 against 1.31 eager) and was slower there: drop it, or use ZeRO-2 or FSDP2 with it"
        )
    if stage == 3 or name.startswith("fsdp"):  # each process holds a shard of each weight, not the weight
        refusals["ema"] = f"--ema_decay averages whole weights and {label} shards them: drop it, or use ZeRO-2 or DDP"
    accelerate, deepspeed = accelerate and f"accelerate_configs/{accelerate}", deepspeed and f"ds_configs/{deepspeed}"
    return StrategySpec(name, label, accelerate, deepspeed, stage, shards, name.endswith("_offload"), refusals)


STRATEGIES: tuple[StrategySpec, ...] = tuple(_spec(*row) for row in _ROWS)
BY_NAME: dict[str, StrategySpec] = {s.name: s for s in STRATEGIES}
ALIASES = {"fsdp": "fsdp2", "fsdp_offload": "fsdp2_offload"}  # names older benchmark records and the advisor used
ORDER: tuple[str, ...] = tuple(s.name for s in STRATEGIES)


def get(name: str) -> StrategySpec:
    """The row for `name` (aliases accepted); KeyError lists the names there are."""
    key = ALIASES.get(name, name)
    if key not in BY_NAME:
        raise KeyError(f"unknown strategy {name!r}; one of {', '.join(ORDER)}")
    return BY_NAME[key]


def identify(zero_stage: int | None, fsdp: bool, offload: bool, zeropp: bool, world_size: int) -> StrategySpec:
    """The row a launch amounts to: DeepSpeed stage and options, FSDP, or plain data parallelism."""
    if fsdp:
        return BY_NAME["fsdp2_offload" if offload else "fsdp2"]
    if zero_stage == 3:
        return BY_NAME["zero3_offload" if offload else "zeropp" if zeropp else "zero3"]
    if zero_stage in (1, 2):
        return BY_NAME["zero2_offload" if offload and zero_stage == 2 else f"zero{zero_stage}"]
    return BY_NAME["ddp" if zero_stage == 0 or world_size > 1 else "single"]
