"""Whether a step's parts compile with XLA one by one: `compiled_blocks()`, which
`kvram.Model(host_offload=True)`'s step enters, and what `Checkpoint` and the fused head read."""

from __future__ import annotations

import contextlib
import threading

_compiling = threading.local()


@contextlib.contextmanager
def compiled_blocks():
    """Within, each `Checkpoint` traced in training compiles its block by itself with XLA: its
    forward pass, and its recomputation and backward pass in the backward (TensorFlow compiles the
    gradient of an XLA function with XLA too). What calls them stays in TensorFlow's executor, so
    each block's weight gradients are outputs of their own computation, there as soon as it ends
    (kvram.Model(host_offload=True) copies them to the host then)."""
    before = getattr(_compiling, "on", False)
    _compiling.on = True
    try:
        yield
    finally:
        _compiling.on = before


def compiling_blocks() -> bool:
    """Whether this thread traces within `compiled_blocks()`: a step that runs in TensorFlow's
    executor while its parts compile with XLA one by one."""
    return getattr(_compiling, "on", False)
