"""accelerate's model unwrap without DeepSpeed's import: its check for a DeepSpeed engine waits for deepspeed's import.

accelerate's `extract_model_from_parallel` (behind `Accelerator.unwrap_model`, which the Trainer calls from its
`__init__` on) imports DeepSpeed whenever it is installed, only to ask whether the model is a `DeepSpeedEngine`: 0.5 s
of every run that does not use DeepSpeed, on a GPU machine. No engine can exist before deepspeed is imported, so the
check can wait for that import. accelerate has no setting or hook for this, hence a patch, on importing this module:
`is_deepspeed_available` as `accelerate.utils.other` (the unwrap's module, alone) sees it, and only while that name is
still accelerate's own function. `tests/test_architecture.py` fails when accelerate's unwrap stops asking through that
name or stops importing deepspeed (the patch would then do nothing, or be needed no more), and when the patch is off.
"""

import sys

import accelerate.utils.imports
import accelerate.utils.other

_installed = accelerate.utils.imports.is_deepspeed_available


def deepspeed_imported_and_installed() -> bool:
    """accelerate's answer (installed), asked only once deepspeed is imported: before that, no engine to unwrap."""
    return "deepspeed" in sys.modules and _installed()


if getattr(accelerate.utils.other, "is_deepspeed_available", None) is _installed:  # not a name of another meaning
    accelerate.utils.other.is_deepspeed_available = deepspeed_imported_and_installed
