"""A `Checkpoint` block run over slices of its rows (`Checkpoint(row_chunks=k)`): `row_chunked`."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from kvram._order import zero_from
from kvram.layers import _compiling


def _ordered(tensors, zero):
    """`tensors` plus `zero` (a float32 0 computed from a tensor): made after that tensor."""
    return [t + tf.cast(zero, t.dtype) if t.dtype.is_floating or t.dtype.is_integer else tf.identity(t)
            for t in tensors]


def row_chunked(forward, chunks: int, n_in: int, state, compiled: bool = False, inputs_host=None, share=None):
    """`forward(*inputs, *state_values)` (a `Checkpoint`'s) over slices of `ceil(rows / chunks)` of
    the inputs' rows, one after another, with `tf.recompute_grad`'s gradient: each slice recomputed
    in the backward pass from its rows, and the variables' gradients summed in float32 over the
    slices. Each slice starts from the state (`state`'s values) its forward pass started from, so
    random layers replay their numbers. Every input is sliced along its first axis.

    Where the rows are known when traced, the equal slices run as one `tf.while_loop` in each pass
    (its body traced, and compiled by XLA, once for any `chunks`) and a shorter last slice, if any,
    after it; otherwise as `chunks` slices written out one after another. With `compiled` and
    `inputs_host` (a CPU's name), the inputs are copied there after the forward pass and released
    to the device's backward pass once the outputs' gradients arrive: the device holds none of them
    in between. With `share` (`_compiling.Shared`), the compiled passes are those of the first block
    alike."""
    from tensorflow.python.eager import record

    def piece(tensors, start, size):
        """Rows start .. start + size of each tensor, fewer where they end first."""
        return [t[start:start + size] for t in tensors]

    def rows_of(tensors, start, size: int):
        """Exactly `size` rows of each tensor from `start` (a tensor in a loop): XLA's dynamic slice."""
        return [tf.slice(t, tf.concat([[start], tf.zeros([t.shape.rank - 1], tf.int32)], 0),
                         [size] + [-1] * (t.shape.rank - 1)) for t in tensors]

    def slice_gradients(inputs, dys, reached, start, size, starts, variables, order, cut=piece):
        """(input gradients, float32 variable gradients) of the slice of `size` rows at `start`
        (taken by `cut`), recomputed from its starting state `starts` once `order` (a zero) is computed."""
        dy = cut(dys, start, size)
        with tf.GradientTape() as tape:
            part = _ordered(cut(inputs, start, size), order)
            tape.watch(part)
            tape.watch(variables)
            again = tree.flatten(forward(*part, *starts))
        grads = tape.gradient([again[j] for j in reached], part + variables, output_gradients=dy,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return ([g if t.dtype.is_floating else None for g, t in zip(grads[:n_in], part)],
                [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads[n_in:]])

    def stacked(array, like):
        """A TensorArray of equal slices as one tensor of their rows, in order."""
        return tf.reshape(array.stack(), tf.concat([[-1], tf.shape(like)[1:]], 0))

    def layout(inputs):  # (size, full, rest): `full` slices of `size` rows, then one of `rest`
        size = -(-inputs[0].shape[0] // chunks)
        return (size, *divmod(inputs[0].shape[0], size))

    def forward_pass(inputs, values, own=()):
        """(the block's outputs over every slice, each equal slice's starting state, stacked, and the
        last slice's). `own`: the block's variables, as arguments (`share`), read through its layer."""
        size, full, rest = layout(inputs)
        # the first slice written out: its outputs give the loop's the structure
        outputs = forward(*piece(inputs, 0, size), *values)
        flat = tree.flatten(outputs)
        starts = [tf.TensorArray(v.dtype, full, element_shape=v.shape).write(0, v) for v in values]
        parts = [tf.TensorArray(t.dtype, full, element_shape=t.shape).write(0, t) for t in flat]
        values = [tf.identity(v.value) for v in state]

        def body(i, values, starts, parts):
            starts = [a.write(i, v) for a, v in zip(starts, values)]
            made = tree.flatten(forward(*rows_of(inputs, i * size, size), *values))
            parts = [a.write(i, t) for a, t in zip(parts, made)]
            return i + 1, [tf.identity(v.value) for v in state], starts, parts

        _, values, starts, parts = tf.while_loop(lambda i, *_: i < full, body, (1, values, starts, parts),
                                                 parallel_iterations=1)
        flat = [stacked(a, t) for a, t in zip(parts, flat)]
        starts = [a.stack() for a in starts]
        last_start = values
        if rest:
            made = tree.flatten(forward(*piece(inputs, full * size, rest), *values))
            flat = [tf.concat([t, m], 0) for t, m in zip(flat, made)]
        return tree.pack_sequence_as(outputs, flat), starts, last_start

    def backward_pass(inputs, dys, starts, last_start, variables, reached):
        """(the inputs' gradients, the variables' float32 gradient sums) over every slice, each
        slice recomputed once the gradients `dys` of the outputs `reached` arrive."""
        size, full, rest = layout(inputs)
        order = zero_from(dys[0])  # recomputed once the gradient arrives
        floating = [i for i, t in enumerate(inputs) if t.dtype.is_floating]
        sums = [tf.zeros(v.shape, tf.float32) for v in variables]
        input_parts = [tf.TensorArray(inputs[i].dtype, full, element_shape=[size] + inputs[i].shape[1:])
                       for i in floating]

        def body(i, sums, input_parts):
            begun = [tf.gather(s, i) for s in starts]
            grads, added = slice_gradients(inputs, dys, reached, i * size, size, begun, variables, order,
                                           cut=rows_of)
            input_parts = [a.write(i, grads[k]) for a, k in zip(input_parts, floating)]
            return i + 1, [s + g for s, g in zip(sums, added)], input_parts

        _, sums, input_parts = tf.while_loop(lambda i, *_: i < full, body, (0, sums, input_parts),
                                             parallel_iterations=1)
        input_grads = [None] * n_in
        for k, a in zip(floating, input_parts):
            input_grads[k] = stacked(a, inputs[k])
        if rest:
            # after the loop's sums: one slice's activations at a time
            after_loop = tf.add_n([zero_from(t) for t in [*sums, *input_grads] if t is not None] + [order])
            grads, added = slice_gradients(inputs, dys, reached, full * size, rest, last_start, variables,
                                           after_loop)
            sums = [s + g for s, g in zip(sums, added)]
            input_grads = [None if g is None else tf.concat([g, grads[k]], 0) for k, g in enumerate(input_grads)]
        return input_grads, sums

    @tf.custom_gradient
    def chunked(*args):
        inputs, values = list(args[:n_in]), list(args[n_in:])
        rows = inputs[0].shape[0]
        if rows is None or rows < 1:
            return _unrolled(inputs, values)
        # With `compiled`, each pass is one XLA computation and this gradient stays outside them: its
        # inputs are this block's own, not an XLA computation's output (which copies an input it
        # passes through: the block's input held twice, 2.3x its size a block with 8 slices).
        own = share.own if share else []
        forward_slices = _compiling.compiled(forward_pass, share, "forward") if compiled else forward_pass
        with record.stop_recording():
            result, starts, last_start = forward_slices(inputs, values, own)
            kept = inputs
            if compiled and inputs_host is not None:
                # Snapshot, not Identity: Grappler removes a chain of identities that leaves a device and
                # comes back, and the device then keeps the input; Snapshot passes on its buffer uncopied
                with tf.device(inputs_host):
                    kept = [tf.raw_ops.Snapshot(input=t, name="block_input_to_host") for t in inputs]
                _compiling.kept_inputs_on_host(inputs)

        def gradient(*dresult, variables=None):
            given = list(variables or [])
            variables = share.variables(given) if share else given
            reached = [j for j, d in enumerate(dresult) if d is not None]  # outputs a gradient reaches
            dys = [dresult[j] for j in reached]
            block_inputs = kept
            if kept is not inputs:  # released to the device once the gradients arrive, not before
                with tf.device(inputs_host), tf.control_dependencies(dys):
                    block_inputs = [tf.raw_ops.Snapshot(input=t, name="block_input_released") for t in kept]

            def backward_slices(inputs, dys, starts, last_start, variables, own):
                return backward_pass(inputs, dys, starts, last_start, variables, reached)

            if compiled:
                backward_slices = _compiling.compiled(backward_slices, share, "backward", tuple(reached),
                                                      tuple((tuple(v.shape), v.dtype.name) for v in variables))
            input_grads, sums = backward_slices(block_inputs, dys, starts, last_start, variables, own)
            sums = {id(v): tf.cast(s, v.dtype) for s, v in zip(sums, variables)}
            return input_grads + [None] * (len(args) - n_in), [sums.get(id(v)) for v in given]

        return result, gradient

    def _unrolled(inputs, values):
        """The slices written out one after another: rows unknown when traced."""
        size = (tf.shape(inputs[0])[0] + chunks - 1) // chunks
        starts, outputs = [], []
        with record.stop_recording():
            for i in range(chunks):
                starts.append(values)
                part = piece(inputs, tf.minimum(i * size, tf.shape(inputs[0])[0]), size)
                if outputs:  # after the slice before it: one slice's activations at a time
                    part = _ordered(part, zero_from(tree.flatten(outputs[-1])[0]))
                outputs.append(forward(*part, *values))
                values = [tf.identity(v.value) for v in state]
        result = tree.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)

        def gradient(*dresult, variables=None):
            variables = list(variables or [])
            sums, input_grads = [tf.zeros(v.shape, tf.float32) for v in variables], []
            reached = [j for j, d in enumerate(dresult) if d is not None]  # outputs a gradient reaches
            dys = [dresult[j] for j in reached]
            order = zero_from(dys[0])  # recomputed once the gradient arrives
            for i in range(chunks):
                start = tf.minimum(i * size, tf.shape(inputs[0])[0])
                grads, added = slice_gradients(inputs, dys, reached, start, size, starts[i], variables, order)
                input_grads.append(grads)
                sums = [s + g for s, g in zip(sums, added)]
                # the next slice recomputed after this one's gradients are summed: one slice's at a time
                made = [zero_from(t) for t in [*sums, *grads] if t is not None]
                order = tf.add_n(made) if made else order
            inputs_grad = [None if parts[0] is None else tf.concat(parts, 0) for parts in zip(*input_grads)]
            return (inputs_grad + [None] * len(starts[0]),
                    [tf.cast(s, v.dtype) for s, v in zip(sums, variables)])

        return result, gradient

    return chunked
