"""Python's cyclic garbage collector while the warm-up compiles: what is alive before it is set aside.

MindSpore runs a full ``gc.collect()`` before compiling each graph (``_CellGraphExecutor.compile``), and a full pass
walks every object of the process: MindSpore's modules, the network's cells, the tokenizer's and schemas' objects.
Measured on the default model's second start (graphs from the graph cache, py-spy): 2.5 s of the warm-up's 6.7 s
were those ten passes. Frozen (``gc.freeze``), the objects that exist before the warm-up are not walked; the pass
still collects what the compiles themselves leave behind.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Freeze every object alive now for the duration, then unfreeze them (``gc.unfreeze``: back in the oldest
    generation, collected as before). Nothing is done when something is frozen already: whoever froze it (serve,
    once its first model is ready) owns the permanent generation, and unfreezing here would undo that."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
