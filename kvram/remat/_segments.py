"""Where a functional Keras model's layer graph can be cut, and the same model rebuilt with chosen stretches as
`kvram.layers.Checkpoint`s.

A *cut* is a point in the graph, taken in topological order, after which
exactly one tensor is still needed: the output of a residual block of a ResNet,
of a ConvNeXt or EfficientNet block, of a ViT encoder block. The stretch
between two consecutive cuts is a *segment*; any run of consecutive segments
can be recomputed as one `Checkpoint` whose only kept tensor is its input.

Works on `keras.applications` models and any functional model with one input
and one output. The rebuilt model calls the *same layer objects*, so it shares
the original's variables (same weights, trained together).
"""

from __future__ import annotations

import dataclasses

import keras

from kvram.layers import Checkpoint
from kvram.training import Model


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers between two consecutive cuts of a functional model.

    Attributes:
        index: position in the chain, from 0.
        layers: names of the layers called in it, in graph order.
        input: the Keras tensor entering it (the model's input for the first).
        output: the Keras tensor leaving it (the model's output for the last).
    """

    index: int
    layers: tuple
    input: object
    output: object


def _functional(model):
    """`model`'s functional graph (a Sequential model's inner one), or a clear error."""
    if isinstance(model, keras.Sequential):
        if getattr(model, "_functional", None) is None:
            raise ValueError(
                f"Sequential model {model.name!r} has no input shape yet, so it has no layer graph to "
                "cut. Give it one: keras.Input(shape) as its first layer, or "
                "model.build((None, *shape)) before planning."
            )
        model = model._functional
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Expected a functional keras.Model (keras.applications, keras.Model(inputs, outputs), "
            f"Sequential). Received: {model!r} of type {type(model).__name__}"
        )
    if not getattr(model, "_nodes_by_depth", None):
        raise ValueError(
            f"{type(model).__name__} {model.name!r} has no layer graph to cut: it is a subclassed "
            "model whose call() is Python code. Allowed: a functional model "
            "(keras.Model(inputs, outputs)), a Sequential model or a keras.applications model; "
            "or wrap its blocks in kvram.layers.Checkpoint by hand."
        )
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(
            f"Model {model.name!r} has {len(model.inputs)} inputs and {len(model.outputs)} outputs; "
            "cutting supports exactly one of each."
        )
    return _flattened(model)


def _graph_of(layer):
    """The functional graph of a nested functional or Sequential model, else None."""
    if isinstance(layer, keras.Sequential):
        layer = getattr(layer, "_functional", None)
    if isinstance(layer, keras.Model) and getattr(layer, "_nodes_by_depth", None):
        return layer
    return None


def _flattened(model):
    """`model` with its nested functional (and Sequential) models inlined: the
    same layer objects called on the outer graph's tensors, so a backbone
    called as one layer (`base = keras.applications.X(include_top=False)`;
    `x = base(inputs)`) is cut at its own blocks. The same variables."""
    if not any(_graph_of(layer) is not None for layer in model.layers):
        return model

    def inline(op):
        inner = _graph_of(op)
        if inner is None:
            return op
        # The nested model's own nodes, on the outer tensors (its call's
        # training/mask arguments are the outer call's at run time).
        return lambda inputs, *args, **kwargs: inner._run_through_graph(inputs, operation_fn=inline)

    inputs = keras.Input(tuple(model.inputs[0].shape[1:]), dtype=model.inputs[0].dtype)
    try:
        flat = keras.Model(inputs, model._run_through_graph(inputs, operation_fn=inline), name=model.name)
    except ValueError as error:
        raise ValueError(
            f"Model {model.name!r} has nested models that could not be inlined into one graph to cut "
            f"it: {error}"
        ) from error
    return _functional(flat)


def _ordered_nodes(model):
    """The model's call nodes in topological order (inputs first)."""
    nodes = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        nodes += [n for n in model._nodes_by_depth[depth] if not n.is_input]
    return nodes


def segments(model: keras.Model) -> list:
    """The finest segments of `model`: the stretches between consecutive points
    of its graph where one tensor alone carries everything later layers need.

    Raises:
        TypeError: `model` is not a Keras model.
        ValueError: `model` has no graph (subclassed), several inputs or outputs,
            or a layer called on both sides of a cut (shared weights would be
            recomputed in one segment and kept in another; the message names it).
    """
    return _chain(_functional(model))


def _chain(model):
    """`segments` of a model `_functional` returned."""
    nodes = _ordered_nodes(model)
    last_use = {}
    for i, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_use[id(tensor)] = i
    last_use[id(model.outputs[0])] = len(nodes)

    found, live = [], {id(model.inputs[0]): model.inputs[0]}
    start, layers = model.inputs[0], []
    for i, node in enumerate(nodes):
        layers.append(node.operation.name)
        for tensor in node.input_tensors:
            if last_use.get(id(tensor)) == i:
                live.pop(id(tensor), None)
        for tensor in node.outputs:
            if id(tensor) in last_use:
                live[id(tensor)] = tensor
        if len(live) == 1:
            (tensor,) = live.values()
            if tensor is start:
                continue
            found.append(Segment(len(found), tuple(layers), start, tensor))
            start, layers = tensor, []
    _check_no_layer_across_cuts(model, found)
    return found


def _check_no_layer_across_cuts(model, found):
    seen = {}
    for segment in found:
        for name in segment.layers:
            first = seen.setdefault(name, segment.index)
            if first != segment.index:
                raise ValueError(
                    f"Layer {name!r} of model {model.name!r} is called in segment {first} and in "
                    f"segment {segment.index}: a layer used on both sides of a cut cannot be "
                    "checkpointed apart. Allowed: each layer called within one segment."
                )


def rebuild(model: keras.Model, groups, checkpoint) -> keras.Model:
    """`model` as a chain of sub-models, each a run of consecutive segments.

    Args:
        model: a functional model (see `segments`).
        groups: lists of consecutive segment indices covering all of
            `segments(model)` in order, e.g. [[0, 1], [2], [3, 4, 5]].
        checkpoint: for each group, whether it runs as a `Checkpoint`.

    Returns:
        A `kvram.Model` calling the same layers (the same variables as `model`).
    """
    model = _functional(model)
    chain = _chain(model)
    flat = [i for group in groups for i in group]
    if flat != list(range(len(chain))):
        raise ValueError(
            f"groups must list the segment indices 0..{len(chain) - 1} once each, in order, "
            f"in runs of consecutive indices. Received: {groups}"
        )
    if len(checkpoint) != len(groups):
        raise ValueError(
            f"checkpoint needs one flag per group ({len(groups)}). Received {len(checkpoint)}."
        )
    inputs = keras.Input(tuple(model.inputs[0].shape[1:]), dtype=model.inputs[0].dtype)
    x = inputs
    for number, (group, recompute) in enumerate(zip(groups, checkpoint)):
        part = keras.Model(
            chain[group[0]].input, chain[group[-1]].output, name=f"{model.name}_part{number}"
        )
        x = (Checkpoint(part) if recompute else part)(x)
    return Model(inputs, x, name=f"{model.name}_remat")


def _groups(runs, n):
    """(groups, flags) for `rebuild` of an n-segment chain with `runs` recomputed."""
    groups, flags, i = [], [], 0
    for first, last in list(runs) + [(n, None)]:
        if i < first:
            groups.append(list(range(i, first)))
            flags.append(False)
        if last is not None:
            groups.append(list(range(first, last + 1)))
            flags.append(True)
            i = last + 1
    return groups, flags
