"""LoRA fine-tuning with peft."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraArguments:
    """LoRA adapters (peft): only the adapters and the classifier head are trained."""

    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names to adapt (default: the attention query and value projections)."},
    )
    merge_adapter: bool = field(
        default=False, metadata={"help": "Save a merged plain model instead of the adapter alone."}
    )
