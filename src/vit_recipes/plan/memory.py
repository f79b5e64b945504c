"""Memory per GPU of each strategy (`estimate`) and host memory for offload, from the config alone (meta device).
tools/advise.py prints the table (its docstring gives the formulas); plan.py and checks.py read it."""

from dataclasses import dataclass

from ..core.errors import RecipeError
from ..model.facts import model_size
from .strategies import STRATEGIES, StrategySpec

GIB = 2**30
BUFFER = 1.5  # DeepSpeed's additional_buffer_factor for host memory, also used for FSDP2's offload
# Shipped configs that autocast over fp32 weights (tests check ds_configs/); offload ones: bf16 mode, 16-bit weights
AUTOCAST = ("zero1", "zero2", "zero3", "zeropp")
# Simplest/fastest first: communication grows down the list, offload trades GPU memory for host bandwidth.
PREFERENCE = ("ddp", "zero1", "zero2", "fsdp2", "zero3", "zeropp", "zero2_offload", "fsdp2_offload", "zero3_offload")


def gib(size: float) -> str:
    return f"{size / GIB:.1f}"


def zero2_states(params: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """(host bytes per node, GPU bytes) of ZeRO-2 model states: DeepSpeed's estimator, or its formula (0.19)."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        n = gpus_per_node * nodes
        if offload:
            return int(params * max(4 * n, 16) * 1.5), 2 * params
        return int(params * 4 * gpus_per_node * 1.5), 2 * params + int(18 * params / n)
    return estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=offload)


def zero3_states(
    params: int, largest: int, gpus_per_node: int, nodes: int, offload: bool, offload_params: bool
) -> tuple[int, int, int]:
    """ZeRO-3's (host per node, GPU, largest-layer) bytes: DeepSpeed's estimator or its formula (0.19, zero_init)."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        n, layer = gpus_per_node * nodes, 4 * largest
        if offload:
            return int(params * 18 / nodes * 1.5), layer, layer
        return int(largest * 4 * gpus_per_node * 1.5), layer + int(18 * params / n), layer
    return estimate_zero3_model_states_mem_needs(
        params, largest, gpus_per_node, nodes, cpu_offload=offload, cpu_offload_params=offload_params, zero_init=True
    )


def fsdp2_offload_host(params: int, nodes: int) -> float:
    """Host bytes per node of FSDP2 with offload: fp32 shards of parameters, gradients and Adam moments."""
    return (4 + 4 + 8) * params / nodes * BUFFER


def host_memory_for(strategy, params: int, largest: int) -> float:
    """Host bytes per node that the offload of a run's `plan.Strategy` needs (DeepSpeed rows run with DeepSpeed)."""
    per_node, nodes, offload = strategy.processes_per_node, strategy.nodes, strategy.offload_optimizer
    if strategy.fsdp:
        return fsdp2_offload_host(params, nodes)
    if strategy.zero_stage == 3:
        return float(zero3_states(params, largest, per_node, nodes, offload, strategy.offload_params)[0])
    return float(zero2_states(params, per_node, nodes, offload)[0])


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a classification model: its sizes (from the meta device) and the config's dims."""

    params: int
    largest_layer_params: int
    layers: int
    hidden: int
    heads: int
    intermediate: int
    image_size: int
    patch_size: int
    num_labels: int
    channels: int = 3

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # patches + [CLS]


def model_shape(config, num_labels: int | None = None, image_size: int | None = None) -> ModelShape:
    """Sizes of the classification model (built on the meta device: no memory) and the config's dimensions."""
    config = config.__class__.from_dict(config.to_dict())  # a copy we may change
    if num_labels:
        config.num_labels = num_labels
    if image_size:
        config.image_size = image_size
    params, largest = model_size(config)
    size, patch = (v[0] if isinstance(v, (list, tuple)) else v for v in (config.image_size, config.patch_size))
    return ModelShape(
        params=params, largest_layer_params=largest, layers=config.num_hidden_layers, hidden=config.hidden_size,
        heads=config.num_attention_heads, intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        image_size=int(size), patch_size=int(patch), num_labels=config.num_labels,
        channels=getattr(config, "num_channels", 3),
    )  # fmt: skip


def activation_bytes(
    shape: ModelShape, batch: int, precision: str = "bf16", checkpointing: bool = False, attention: str = "sdpa"
) -> float:
    """Activations kept for the backward pass on one GPU, in bytes (see the module docstring)."""
    e = 4 if precision == "fp32" else 2
    b, s, h, i, a = batch, shape.tokens, shape.hidden, shape.intermediate, shape.heads
    per_layer = s * b * (8 * h + 2 * i) * e + (4 * b * a * s if attention == "sdpa" else b * a * s * s * e)
    once = b * shape.channels * shape.image_size**2 * e + s * b * h * e + b * (h + 2 * shape.num_labels) * 4
    if checkpointing:
        return shape.layers * s * b * h * e + per_layer + once
    return shape.layers * per_layer + once


def model_states(key: str, shape: ModelShape, gpus_per_node: int, nodes: int, precision: str = "bf16"):
    """(params, grads, optimizer) bytes per GPU and host bytes per node for one strategy."""
    from accelerate.commands.estimate import estimate_training_usage

    P, L, n = shape.params, shape.largest_layer_params, gpus_per_node * nodes
    ddp = estimate_training_usage(4 * P, "float32" if precision == "fp32" else "bfloat16")
    in_flight = 2 * L * (4 if precision == "fp32" else 2)  # FSDP2: two unsharded layers in the compute dtype
    if precision != "fp32" and key.startswith("zero") and key not in AUTOCAST:  # DeepSpeed's bf16 mode: offload
        if key == "zero2_offload":  # 16-bit weights on the GPU, the rest on the host
            host, gpu = zero2_states(P, gpus_per_node, nodes, offload=True)
        else:
            host, gpu, _ = zero3_states(P, L, gpus_per_node, nodes, offload=True, offload_params=True)
        return float(gpu), 0.0, 0.0, float(host)
    # ZeRO over fp32 weights (not what DeepSpeed's estimators assume): an fp32 master copy (4P/N) beside Adam's
    rows = {
        "ddp": (ddp["model"], ddp["gradients"], ddp["optimizer"], 0.0),
        "fsdp2": (ddp["model"] / n + in_flight, ddp["gradients"] / n, ddp["optimizer"] / n, 0.0),
        "fsdp2_offload": (in_flight, in_flight / 2, 0.0, fsdp2_offload_host(P, nodes)),
        "zero1": (4 * P, 4 * P, 12 * P / n, 0.0),
        "zero2": (4 * P, 4 * P / n, 12 * P / n, 0.0),
        "zero2_offload": (4 * P, 0.0, 0.0, (4 + 8) * P / nodes * BUFFER),
        "zero3": (4 * P / n + 8 * L, 4 * P / n, 12 * P / n, 0.0),
        "zeropp": (4 * P / n + 8 * L + 4 * P / gpus_per_node, 4 * P / n, 12 * P / n, 0.0),
        "zero3_offload": (8 * L, 0.0, 0.0, (4 + 4 + 8) * P / nodes * BUFFER),
    }
    return rows[key]


@dataclass
class Estimate:
    """One strategy's memory per GPU, in bytes (host memory per node for what it offloads)."""

    strategy: StrategySpec
    params: float  # bytes per GPU
    grads: float
    optimizer: float
    activations: float  # without checkpointing
    activations_ckpt: float  # with gradient checkpointing
    host_per_node: float  # bytes of host memory per node for offloaded states
    overhead: float

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.overhead

    @property
    def total_ckpt(self) -> float:
        return self.states + self.activations_ckpt + self.overhead


def estimate(
    shape: ModelShape, gpus: int, batch: int, nodes: int = 1, precision: str = "bf16", attention: str = "sdpa",
    overhead_gib: float = 2.0, keys: tuple[str, ...] | None = None,
) -> list[Estimate]:  # fmt: skip
    """Every multi-process strategy's (or those in `keys`) memory per GPU for `shape` at per-device `batch`."""
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise RecipeError(f"--gpus {gpus} must be a positive multiple of --nodes {nodes}")
    act, act_ckpt = (activation_bytes(shape, batch, precision, ckpt, attention) for ckpt in (False, True))
    out = []
    for spec in (s for s in STRATEGIES if s.name != "single" and (not keys or s.name in keys)):  # multi-process rows
        params, grads, optimizer, host = model_states(spec.name, shape, gpus // nodes, nodes, precision)
        out.append(Estimate(spec, params, grads, optimizer, act, act_ckpt, host, overhead_gib * GIB))
    return out
