"""Per-call options of `tf.function`s, and one op order for training steps on
TensorFlow's graph executor (a leaf: it imports nothing of kvram's).

On TensorFlow's default executor the order in which independent ops run, and
so a training step's memory peak, varies from step to step and from trace to
trace: MobileNetV2 on the CPU (64x64, batch 16), planned for the least memory
in that executor, peaked at 0.72x plain Keras, and a plan for 0.7x plain
peaked 34% over it. A step that `kvram.remat.plan` measured in one order
(`one_op_order`) and that trains in that order peaks as measured. XLA fixes
its order when it compiles, so an XLA-compiled step needs none of this.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def call_options(executor_type=None, **rewrites):
    """Within, `tf.function`s called (and traced) on this thread run with the
    per-call options that eager function calls carry (their `config_proto`,
    which Grappler reads, and their executor) amended: `rewrites` set fields
    of Grappler's `RewriterConfig`; `executor_type` (e.g.
    "SINGLE_THREADED_EXECUTOR") replaces the executor when given. Restored
    after."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    saved = ctx.function_call_options
    config = config_pb2.ConfigProto()
    if saved.config_proto_serialized:
        config.ParseFromString(saved.config_proto_serialized)
    for field, value in rewrites.items():
        setattr(config.graph_options.rewrite_options, field, value)
    ctx.function_call_options = context.FunctionCallOptions(
        executor_type=saved.executor_type if executor_type is None else executor_type, config_proto=config
    )
    try:
        yield
    finally:
        ctx.function_call_options = saved


def one_op_order():
    """Within, `tf.function`s called on this thread run their ops in one
    order: on TensorFlow's single-threaded executor (each op still uses the
    intra-op threads), with Grappler's dependency and memory optimizers off.
    A trace's peak then repeats to the byte, step after step; traces of one
    model still differ a little (`kvram.remat._check`'s settled checks)."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    off = rewriter_config_pb2.RewriterConfig
    # the memory optimizer's AddN rewrite (DenseNet's gradient sums) makes
    # reference-typed edges, which the single-threaded executor refuses
    return call_options(
        executor_type="SINGLE_THREADED_EXECUTOR",
        dependency_optimization=off.OFF,
        memory_optimization=off.NO_MEM_OPT,
    )


def in_one_op_order() -> bool:
    """Whether this thread's `tf.function`s run on the single-threaded executor."""
    from tensorflow.python.eager import context

    return context.context().function_call_options.executor_type == "SINGLE_THREADED_EXECUTOR"
