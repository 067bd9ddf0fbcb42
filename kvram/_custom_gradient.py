"""`tf.custom_gradient` and `tf.recompute_grad` trace in time linear in a model's depth.

When TensorFlow traces a function decorated with `tf.custom_gradient` into a graph
(every `tf.function`, so every compiled train step), it looks for the variables the
function uses in two ways: a `VariableWatcher` records every variable read while
the function runs, and `_get_dependent_variables` walks the graph backwards from
the function's outputs until it meets the function's inputs
(tensorflow/python/ops/custom_gradient.py, `_graph_mode_decorator`). That walk does
not stop at the function's own ops: whatever the function closes over leads it
into the rest of the graph. `tf.recompute_grad`'s backward is such a function, and
it closes over the block's forward inputs and adds the incoming gradient to them,
so the walk made while tracing block k's backward crosses the backward of every
block after k and the forward of every block before it: tracing a model of L
checkpointed blocks costs O(L^2). The same holds for each custom-gradient attention or loss inside
a block. Measured on a 2-core CPU (2026-12-05, `benchmarks/optimizers/capacity.py --runs
kvram_state:87 --sequence 64 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --vocabulary 512
--device CPU:0`, sampled with py-spy): still tracing after 5 minutes of CPU time, 91% of it in this
walk; with the walk bounded, the whole trace took about 3 minutes.

The walk can only find a variable through its variable op (`VarHandleOp`,
`VariableV2`) reached from a read. Reads that happen inside the function are
already recorded by the watcher; in a `tf.function`'s graph a variable made outside
it is a captured placeholder, which the walk does not report anyway. So here the
walk is bounded to the ops the function itself created (those with a larger id
than the graph's last op when the function was called): the same variables are
found, and each call costs what its own ops do.

Upstream: no TensorFlow issue reports this walk (searched 2026-12-05); tensorflow/tensorflow#9901
reports gradient construction that scales with the size of the whole graph in general.
`tests/test_custom_gradient.py` checks the premise (TensorFlow's walk grows faster than the depth)
and the bound.

`install()` (called by `import kvram`) replaces the two private functions once;
`installed()` says whether it has.
"""

from __future__ import annotations

import threading

from tensorflow.python.framework import ops
from tensorflow.python.ops import custom_gradient, gen_array_ops, op_selector
from tensorflow.python.util import nest

_starts = threading.local()
_original_decorator = custom_gradient._graph_mode_decorator
_original_dependent = custom_gradient._get_dependent_variables


def _stack() -> list:
    if not hasattr(_starts, "stack"):
        _starts.stack = []
    return _starts.stack


def _graph_mode_decorator(f, args, kwargs):
    """TensorFlow's, with the graph's last op id noted while it runs."""
    stack = _stack()
    stack.append(ops.get_default_graph().version)
    try:
        return _original_decorator(f, args, kwargs)
    finally:
        stack.pop()


def _get_dependent_variables(input_ops, output_ops):
    """TensorFlow's `_get_dependent_variables`, its walk kept to the ops the function created."""
    stack = _stack()
    if not stack:  # called from elsewhere: TensorFlow's own
        return _original_dependent(input_ops, output_ops)
    start = stack[-1]
    output_ops = nest.map_structure(gen_array_ops.identity, output_ops)
    inbetween_ops = op_selector.get_backward_walk_ops(
        seed_ops=output_ops, stop_at_ts=input_ops, inclusive=False, only_differentiable=True,
        within_ops_fn=lambda op: op._id > start)
    var_ops = (op for op in inbetween_ops if op.type in custom_gradient.VAR_OP_TYPES)
    tf_vars = (custom_gradient.get_variable_by_name(op.name) for op in var_ops)
    return [v for v in tf_vars if v is not None]


def install() -> None:
    custom_gradient._graph_mode_decorator = _graph_mode_decorator
    custom_gradient._get_dependent_variables = _get_dependent_variables


def installed() -> bool:
    return custom_gradient._graph_mode_decorator is _graph_mode_decorator
