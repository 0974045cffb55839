"""Python's cyclic garbage collector paused while tkopt traces and optimizes a model."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off for the block, then back as it was. Tracing a whole model allocates enough objects to
    start several full collections, each walking every object the process holds (GPT-2 8x1024 on the CPU: about
    0.2 s each once the model and its export are alive; export and passes 2.67 -> 2.45 s). The cycles the block
    leaves are collected once the collector runs again. Usable as a decorator."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
