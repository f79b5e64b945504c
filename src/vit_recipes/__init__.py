"""Recipes to fine-tune Vision Transformers with transformers, DeepSpeed and FSDP."""

import logging
import warnings

__version__ = "0.1.0"

# Library messages that are never about the user's data or settings, logged at import by packages a run may not even
# use (transformers imports torchao and accelerate imports DeepSpeed whenever they are installed). Each filter drops
# exactly one message on its library's logger; everything else those loggers say still shows.
_NOISE = {
    "torchao": "Failed to load ",  # its kernels for other platforms (CUDA/sm_90a libraries on a CPU torch)
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",  # torchao's use of a torch API
    "DeepSpeed": "Setting accelerator to CPU",  # said on every CPU machine, DeepSpeed used or not
}


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


for _name, _text in _NOISE.items():
    logging.getLogger(_name).addFilter(_DropMessage(_text))

# peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model: a deprecation between
# two libraries, which says nothing about the run.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
