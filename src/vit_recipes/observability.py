"""Tracking, profiling and plots."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ObservabilityArguments:
    """Profiler traces and plots written next to the model."""

    profile_steps: str | None = field(
        default=None,
        metadata={"help": "Capture PyTorch profiler traces for these training steps, e.g. '20-25' (after warm-up)."},
    )
    plots: bool = field(default=True, metadata={"help": "Write loss/learning-rate/metric PNG plots after the run."})
