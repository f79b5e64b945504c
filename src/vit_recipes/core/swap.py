"""`swapped(obj, name, value)`: one attribute set for the length of a block, then restored however the block ends."""

import contextlib


@contextlib.contextmanager
def swapped(obj, name: str, value):
    """Set `obj.<name>` to `value` inside the block; restore the old value after it, even when the block raises.

    Where an upstream method reads a setting that must differ for one call (the Trainer's `dataloader_drop_last` for
    an evaluation loader, say), we swap the field around the call rather than copy the method. The attribute must
    exist: a field renamed upstream fails here, loudly, instead of setting a new one that nothing reads.
    """
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield obj
    finally:
        setattr(obj, name, old)
