"""Whether a step's parts compile with XLA one by one: `compiled_blocks()`, which
`kvram.Model(host_offload=True)`'s step enters, and what `Checkpoint` and the fused head read."""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from kvram._order import in_xla

_compiling = threading.local()


@contextlib.contextmanager
def compiled_blocks(inputs_host=None):
    """Within, each `Checkpoint` traced in training compiles its block by itself with XLA: its
    forward pass, and its recomputation and backward pass in the backward (TensorFlow compiles the
    gradient of an XLA function with XLA too). What calls them stays in TensorFlow's executor, so
    each block's weight gradients are outputs of their own computation, there as soon as it ends
    (kvram.Model(host_offload=True) copies them to the host then). `inputs_host` (a CPU's name):
    each row-chunked block keeps its input there between its forward and backward passes
    (`HostOffload(block_inputs="host")`). Yields a record of what was traced within."""
    before = (getattr(_compiling, "on", False), getattr(_compiling, "inputs_host", None),
              getattr(_compiling, "record", None))
    record = _compiling.record = _Record()
    _compiling.on, _compiling.inputs_host = True, inputs_host
    try:
        yield record
    finally:
        _compiling.on, _compiling.inputs_host, _compiling.record = before


class _Record:
    """What `compiled_blocks()` saw traced within it: `kept_inputs`, the blocks that kept their
    inputs on the host, and `kept_bytes`, those inputs' size."""

    def __init__(self):
        self.kept_inputs = 0
        self.kept_bytes = 0


def kept_inputs_on_host(inputs) -> None:
    """A row-chunked block traced within `compiled_blocks()` keeps its `inputs` (of known shapes)
    on the host."""
    record = _compiling.record
    record.kept_inputs += 1
    record.kept_bytes += sum((t.shape.num_elements() or 0) * t.dtype.size for t in inputs)


def compiling_blocks() -> bool:
    """Whether this thread traces within `compiled_blocks()`: a step that runs in TensorFlow's
    executor while its parts compile with XLA one by one."""
    return getattr(_compiling, "on", False)


def alone_in_xla(x) -> bool:
    """Whether `x` is traced into a graph outside XLA whose parts compile with XLA by themselves
    (within `compiled_blocks()`): a part that would make float32 copies of a large tensor as
    TensorFlow ops (the fused head, the lean norms) compiles itself there."""
    return compiling_blocks() and not tf.executing_eagerly() and not in_xla(x)


def block_inputs_host():
    """Where row-chunked blocks keep their inputs within `compiled_blocks()` (a CPU's name), or None:
    where they were made."""
    return getattr(_compiling, "inputs_host", None) if compiling_blocks() else None
