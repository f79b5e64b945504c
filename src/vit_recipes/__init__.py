"""Recipes to fine-tune Vision Transformers with transformers, DeepSpeed and FSDP.

Its folders by concern, bottom to top: core/, data/, model/, plan/, publish/, train/ (each imports only folders
below it, as its own docstring says), and at the root the script's steps (steps.py) and `adapters.load_model`, the
public import. docs/development.md draws the map."""

import logging
import warnings

__version__ = "0.1.0"

# Import-time library messages that never concern the user's data or settings (transformers imports torchao and
# accelerate imports DeepSpeed whenever installed): each filter drops exactly one message on its library's logger.
_NOISE = {
    "torchao": "Failed to load ",  # its kernels for other platforms (CUDA/sm_90a libraries on a CPU torch)
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",  # torchao's use of a torch API
    "DeepSpeed": "Setting accelerator to CPU",  # said on every CPU machine, DeepSpeed used or not
}
for _name, _text in _NOISE.items():
    logging.getLogger(_name).addFilter(lambda record, text=_text: text not in record.getMessage())

# peft (0.21) reads transformers' deprecated `is_gradient_checkpointing`: a deprecation between two libraries.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
