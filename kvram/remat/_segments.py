"""Where a functional Keras model's layer graph can be cut, and the same model
rebuilt with chosen stretches as `kvram.layers.Checkpoint`s.

A *cut* is a point in the graph, taken in topological order, after which one
tensor of the main path alone carries what later layers need from it: the
output of a residual block of a ResNet, of a ConvNeXt or EfficientNet block, of
a ViT, BERT or GPT encoder/decoder block. Other tensors may cross a cut beside
it as *side inputs*: a model input that does not depend on the main one (a
padding mask, position ids, segment ids), a tensor computed from such inputs
alone (an attention bias), and an output already computed (a model with several
outputs). They are carried across every cut unchanged. The stretch between two
consecutive cuts is a *segment*; any run of consecutive segments can be
recomputed as one `Checkpoint` whose kept tensors are its inputs.

Works on `keras.applications` models, KerasHub backbones and any functional
model, with one input or several (a list or a dict), one output or several,
and with nested functional models (inlined). The rebuilt model calls the *same
layer objects*, so it shares the original's variables (same weights, trained
together), and takes and returns the same structures.
"""

from __future__ import annotations

import dataclasses

import keras
from keras import tree

from kvram._state import mutable_state
from kvram.layers.checkpoint import POLICIES, Checkpoint
from kvram.training import Model


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers between two consecutive cuts of a functional model.

    Attributes:
        index: position in the chain, from 0.
        layers: names of the layers called in it, in graph order.
        input: the main Keras tensor entering it (the model's main input for
            the first).
        output: the main Keras tensor leaving it (a model output for the last).
        side_inputs: the other tensors entering it (masks, position ids,
            outputs computed before), carried past the cut; () for most models.
        side_outputs: the other tensors leaving it.
    """

    index: int
    layers: tuple
    input: object
    output: object
    side_inputs: tuple = ()
    side_outputs: tuple = ()
    nodes: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def inputs(self) -> list:
        return [self.input, *self.side_inputs]

    @property
    def outputs(self) -> list:
        return [self.output, *self.side_outputs]


def _functional(model):
    """`model`'s functional graph (a Sequential model's inner one) with nested
    functional models inlined, or a clear error."""
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
            "Expected a functional keras.Model (keras.applications, a KerasHub backbone, "
            f"keras.Model(inputs, outputs), Sequential). Received: {model!r} of type {type(model).__name__}"
        )
    if not getattr(model, "_nodes_by_depth", None):
        raise ValueError(
            f"{type(model).__name__} {model.name!r} has no layer graph to cut: it is a subclassed "
            "model whose call() is Python code. Allowed: a functional model "
            "(keras.Model(inputs, outputs)), a Sequential model, a keras.applications model or a "
            "KerasHub backbone; or wrap its blocks in kvram.layers.Checkpoint by hand."
        )
    return _flattened(model)


def _graph_of(layer):
    """The functional graph of a nested functional or Sequential model, else None."""
    if isinstance(layer, keras.Sequential):
        layer = getattr(layer, "_functional", None)
    if isinstance(layer, keras.Model) and getattr(layer, "_nodes_by_depth", None):
        return layer
    return None


def _new_inputs(model):
    """Fresh `keras.Input`s like `model`'s, in its input structure (a dict's
    inputs named for their keys, as Keras asks)."""
    struct = model._inputs_struct
    if isinstance(struct, dict):
        return {key: keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype, name=key) for key, t in struct.items()}
    return tree.map_structure(lambda t: keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype), struct)


def _flattened(model):
    """`model` with its nested functional (and Sequential) models inlined: the
    same layer objects called on the outer graph's tensors, so a backbone
    called as one layer (`base = keras.applications.X(include_top=False)`;
    `x = base(inputs)`, or a KerasHub backbone under a task's head) is cut at
    its own blocks. The same variables."""
    if not any(_graph_of(layer) is not None for layer in model.layers):
        return model

    def inline(op):
        inner = _graph_of(op)
        if inner is None:
            return op
        # The nested model's own nodes, on the outer tensors (its call's
        # training/mask arguments are the outer call's at run time).
        return lambda inputs, *args, **kwargs: inner._run_through_graph(inputs, operation_fn=inline)

    inputs = _new_inputs(model)
    try:
        flat = keras.Model(inputs, model._run_through_graph(inputs, operation_fn=inline), name=model.name)
    except ValueError as error:
        raise ValueError(
            f"Model {model.name!r} has nested models that could not be inlined into one graph to cut "
            f"it: {error}"
        ) from error
    return _functional(flat)


def _ordered_nodes(model):
    """The model's call nodes in topological order (inputs first): Keras's
    order by depth (distance to the outputs), except that a head whose
    outputs are only model outputs (an early output of a model with several)
    comes right after its inputs are made, not at the end, where it would keep
    its input alive across every later block."""
    nodes = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        nodes += [n for n in model._nodes_by_depth[depth] if not n.is_input]
    read = {id(t) for n in nodes for t in n.input_tensors}
    outputs = {id(t) for t in model.outputs}
    heads = [n for n in nodes if all(id(t) in outputs and id(t) not in read for t in n.outputs)]
    for head in heads:
        nodes.remove(head)
        made = [i for i, n in enumerate(nodes) if {id(t) for t in n.outputs} & {id(t) for t in head.input_tensors}]
        nodes.insert(max(made) + 1 if made else 0, head)
    return nodes


def segments(model: keras.Model) -> list:
    """The finest segments of `model`: the stretches between consecutive points
    of its graph where one tensor of the main path carries everything later
    layers need from it (see the module docstring for the side inputs carried
    beside it).

    Raises:
        TypeError: `model` is not a Keras model.
        ValueError: `model` has no graph (subclassed), or a layer with its own
            state (BatchNormalization's statistics, a seed) called on both sides
            of a cut (the message names it).
    """
    return _chain(_functional(model))


def _main_input(model, nodes):
    """The input most of the graph descends from (the first such)."""
    if len(model.inputs) == 1:
        return model.inputs[0]
    below = {}
    for tensor in model.inputs:
        reached, count = {id(tensor)}, 0
        for node in nodes:
            if any(id(t) in reached for t in node.input_tensors):
                count += 1
                reached |= {id(t) for t in node.outputs}
        below[id(tensor)] = count
    return max(model.inputs, key=lambda t: below[id(t)])


def _side_tensors(model, nodes, main):
    """ids of the tensors that do not descend from the main input."""
    descends = {id(main)}
    for node in nodes:
        if any(id(t) in descends for t in node.input_tensors):
            descends |= {id(t) for t in node.outputs}
    side = {id(t) for t in model.inputs if id(t) not in descends}
    for node in nodes:
        for t in node.outputs:
            if id(t) not in descends:
                side.add(id(t))
    return side


def _chain(model):
    """`segments` of a model `_functional` returned."""
    nodes = _ordered_nodes(model)
    main = _main_input(model, nodes)
    side = _side_tensors(model, nodes, main)
    last_use = {}
    for i, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_use[id(tensor)] = i
    consumed = dict(last_use)  # its last reader among the nodes
    outputs = {id(t) for t in model.outputs}
    for tensor in model.outputs:
        last_use[id(tensor)] = len(nodes)

    def carried(key, i):
        """Whether the live tensor `key` may cross the cut after node i beside the main one."""
        return key in side or (key in outputs and consumed.get(key, -1) <= i)

    found = []
    live = {id(t): t for t in model.inputs if id(t) in last_use}
    start, start_sides, layers, called = main, tuple(t for t in model.inputs if t is not main and id(t) in last_use), [], []
    for i, node in enumerate(nodes):
        layers.append(node.operation.name)
        called.append(node)
        for tensor in node.input_tensors:
            if last_use.get(id(tensor)) == i:
                live.pop(id(tensor), None)
        for tensor in node.outputs:
            if id(tensor) in last_use:
                live[id(tensor)] = tensor
        if i == len(nodes) - 1:
            break
        mains = [t for key, t in live.items() if not carried(key, i)]
        if len(mains) != 1 or mains[0] is start:
            continue
        sides = tuple(t for key, t in live.items() if carried(key, i))
        found.append(Segment(len(found), tuple(layers), start, mains[0], start_sides, sides, tuple(called)))
        start, start_sides, layers, called = mains[0], sides, [], []
    # the last segment ends with the model's outputs: the last one computed
    # from the main input as its main output, the others beside it
    ends = list({id(t): t for t in model.outputs}.values())
    last = next((t for t in reversed(ends) if id(t) not in side), ends[-1])
    found.append(Segment(len(found), tuple(layers), start, last, start_sides,
                         tuple(t for t in ends if t is not last), tuple(called)))
    _check_no_layer_across_cuts(model, found)
    return found


def _check_no_layer_across_cuts(model, found):
    seen = {}
    layers = {layer.name: layer for layer in model._flatten_layers(include_self=False, recursive=True)}
    for segment in found:
        for name in segment.layers:
            first = seen.setdefault(name, segment.index)
            if first != segment.index and layers.get(name) is not None and mutable_state(layers[name]):
                raise ValueError(
                    f"Layer {name!r} of model {model.name!r} is called in segment {first} and in "
                    f"segment {segment.index}, and has state of its own (non-trainable variables: "
                    "moving statistics, a seed): recomputing one call would put its state back "
                    "where the other call left it. Allowed: a layer with state called within one "
                    "segment; layers with weights alone (a tied embedding, frozen or not) may be "
                    "called in several."
                )


def rebuild(model: keras.Model, groups, checkpoint, policy: str = "full", row_chunks=None) -> keras.Model:
    """`model` as a chain of sub-models, each a run of consecutive segments.

    Args:
        model: a functional model (see `segments`).
        groups: lists of consecutive segment indices covering all of
            `segments(model)` in order, e.g. [[0, 1], [2], [3, 4, 5]].
        checkpoint: for each group, whether it runs as a `Checkpoint`.
        policy: the `Checkpoint` policy of those groups ("full": recompute
            everything; "save_dots": keep the Dense/EinsumDense products).
        row_chunks: those groups' `Checkpoint` `row_chunks` (None: the whole
            batch at once).

    Returns:
        A `kvram.Model` calling the same layers (the same variables as
        `model`), taking and returning the same structures.
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
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}. Received: policy={policy!r}")
    inputs = _new_inputs(model)
    tensors = {id(old): new for old, new in zip(model.inputs, tree.flatten(inputs))}
    for number, (group, recompute) in enumerate(zip(groups, checkpoint)):
        first, last = chain[group[0]], chain[group[-1]]
        part = _part(chain[group[0]:group[-1] + 1], f"{model.name}_part{number}")
        call = Checkpoint(part, policy=policy, row_chunks=row_chunks) if recompute else part
        if _single(first, last):
            tensors[id(last.output)] = call(tensors[id(first.input)])
        else:
            results = tree.flatten(call([tensors[id(t)] for t in first.inputs]))
            tensors.update((id(t), r) for t, r in zip(last.outputs, results))
    outputs = tree.pack_sequence_as(model._outputs_struct, [tensors[id(t)] for t in model.outputs])
    return Model(inputs, outputs, name=f"{model.name}_remat")


def _single(first, last) -> bool:
    """Whether a run from segment `first` to `last` takes one tensor and gives one."""
    return not first.side_inputs and not last.side_outputs


def _part(run, name):
    """The run of segments `run` as a functional model of the same layers: its
    first segment's inputs (one tensor, or the main one and the side inputs,
    a list) to its last segment's outputs. Built on fresh `keras.Input`s
    with the original nodes replayed on them: Keras's own model of
    intermediate tensors compares them with `==` when there are several
    (`tensor in flat_inputs`, keras/src/ops/function.py `_build_map_helper`),
    which stops its walk at the wrong tensor ("Output ... is not connected")."""
    first, last = run[0], run[-1]

    def fresh(t):
        return keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype)

    entering = [first.input] if _single(first, last) else first.inputs
    inputs = [fresh(t) for t in entering]
    tensors = {id(t): f for t, f in zip(entering, inputs)}
    for segment in run:
        for node in segment.nodes:
            args, kwargs = node.arguments.fill_in(tensors)
            made = node.operation(*args, **kwargs)
            tensors.update((id(t), m) for t, m in zip(node.outputs, tree.flatten(made)))
    if _single(first, last):
        return keras.Model(inputs[0], tensors[id(last.output)], name=name)
    return keras.Model(inputs, [tensors[id(t)] for t in last.outputs], name=name)


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
