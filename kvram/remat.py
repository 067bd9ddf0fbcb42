"""Checkpointing any functional Keras model (issue 12): where its layer graph
can be cut, and the same model rebuilt with chosen stretches as
`kvram.layers.Checkpoint`s.

A *cut* is a point in the graph, taken in topological order, after which
exactly one tensor is still needed: the output of a residual block of a ResNet,
of a ConvNeXt or EfficientNet block, of a ViT encoder block. The stretch
between two consecutive cuts is a *segment*; any run of consecutive segments
can be recomputed as one `Checkpoint` whose only kept tensor is its input.

Works on `keras.applications` models and any functional model with one input
and one output. The rebuilt model calls the *same layer objects*, so it shares
the original's variables (same weights, trained together).

`plan(model, sample_batch, budget_bytes)` chooses which segments to recompute
so that a training step fits a memory budget with the least recomputation:

1. *Measure* one training step of the model as it is, on the device it will
   train on (one compiled step, `tf.function` without XLA), with a probe at each
   cut in the forward and in the backward pass that reads TensorFlow's allocator:
   the bytes each segment leaves held for the backward pass, and the peak of
   every stretch of the step.
2. *Predict* the peak of any choice: checkpointing a run of segments frees what
   those segments kept (less the one tensor the run hands on) for every later
   part of the step, and costs one more forward pass of the run.
3. *Choose* by an exact dynamic programme over the chain: the least
   recomputation (forward FLOPs derived from the layers' shapes) whose predicted
   peak fits the budget; with no budget, the least peak that checkpointing can
   reach (the point Chen et al. 2016's square-root split aims at), with the
   least recomputation that reaches it.
4. *Check*: the unmodified step, the least-memory candidates (step 3's
   choice, its choices a few percent above that peak, and the square-root
   split: step 2 errs most where most is recomputed) and the chosen one are
   each run on the sample batch as training will run them, and their
   allocator peaks replace the predictions; the least-memory choice is the
   candidate with the lowest checked peak. Under XLA (by default on a GPU,
   where Keras compiles the step with XLA) the step is XLA-compiled: XLA
   fuses and reschedules it, so step 1's measurement over-predicts it
   (ResNet50 on an H200: 1.44-1.55x), and fixes its buffers at compile time,
   so one run gives its peak. Otherwise the step runs on the graph executor,
   without step 1's probes (which order the ops), the highest of three runs.
   When the chosen one is over the budget, the budget given to step 3 is
   lowered by the overshoot (mapped between the two measured ends) and
   step 3 repeats.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import keras
import numpy as np
import tensorflow as tf

from kvram import memory
from kvram.layers.checkpoint import Checkpoint
from kvram.model import Model

__all__ = ["Segment", "segments", "rebuild", "plan", "Plan"]


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


# ---------------------------------------------------------------------------
# Measuring a training step, cut by cut.


@dataclasses.dataclass(frozen=True)
class _Profile:
    """One measured training step of the unmodified model (bytes beyond what
    was allocated before the step; per segment, in chain order).

    kept: bytes the forward pass of each segment left allocated (its saved
        activations, and its output while the next segment runs).
    need: the highest allocation while the segment's forward or backward pass ran.
    recompute: the allocation a recomputation of runs ending at the segment
        starts from: held when the gradient reached the segment's output, plus
        the segment's forward transient (its forward peak above what it kept);
        None where no gradient reaches it.
    head: the highest allocation while the loss and its gradient ran.
    output: bytes of each segment's output tensor.
    input: bytes of the model's input batch.
    flops: forward FLOPs of each segment (derived from layer shapes).
    """

    kept: tuple
    need: tuple
    recompute: tuple
    transient: tuple
    head: int
    output: tuple
    input: int
    flops: tuple


def _probe_step(parts, x, y, loss_fn, variables, device):
    """The training step of `parts` chained, with allocator probes at each cut.

    Returns (a tf.function, the dict its probes write into). A probe is a
    `tf.py_function` ordered by control dependencies after the tensor it marks
    (forward: a segment's output; backward: the gradient reaching it); it
    records the allocator's current and peak bytes, then resets the peak, so
    each probe's peak covers the stretch since the previous one.
    """
    records = {}

    def reader(key):
        def read():
            info = tf.config.experimental.get_memory_info(device)
            records[key] = (int(info["current"]), int(info["peak"]))
            tf.config.experimental.reset_memory_stats(device)
            return np.int32(0)

        return read

    def mark(tensor, key):
        with tf.control_dependencies([tensor]):
            done = tf.py_function(reader(key), [], tf.int32)
        with tf.control_dependencies([done]):
            return tf.identity(tensor)

    def probe(tensor, index):
        @tf.custom_gradient
        def identity(t):
            return mark(t, ("forward", index)), lambda dy: mark(dy, ("backward", index))

        return identity(tensor)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for index, part in enumerate(parts):
                h = probe(part(h, training=True), index)
            loss = loss_fn(y, h)
        gradients = [g for g in tape.gradient(loss, variables) if g is not None]
        with tf.control_dependencies(gradients):
            done = tf.py_function(reader(("end",)), [], tf.int32)
        # Returned, as a training step holds them until the optimizer applies them.
        return gradients, done

    return step, records


def _profile(model, chain, x, y, loss_fn, device):
    parts = [keras.Model(s.input, s.output, name=f"{model.name}_segment{s.index}") for s in chain]
    step, records = _probe_step(parts, x, y, loss_fn, model.trainable_variables, device)
    step()  # the first run also allocates what the runtime keeps (kernel caches)
    # The executor's order of independent ops, and so each stretch's peak, varies
    # from step to step: the peaks are the highest of several steps, as the
    # memory a training run needs is its highest step's.
    # What segments keep is steadier: its median is taken.
    runs = [_probe_run(step, records, device, len(chain)) for _ in range(_PROFILE_STEPS)]
    kept, need, recompute, transient, heads = (list(zip(*field)) for field in zip(*runs))
    kept = tuple(int(np.median(values)) for values in kept)
    need, transient = (tuple(max(values) for values in field) for field in (need, transient))
    recompute = tuple(None if None in values else max(values) for values in recompute)
    (head,) = (max(values) for values in heads)
    batch = int(x.shape[0])
    output = [batch * _elements(s.output) * np.dtype(s.output.dtype).itemsize for s in chain]
    return _Profile(
        kept=kept,
        need=need,
        recompute=recompute,
        transient=transient,
        head=head,
        output=tuple(output),
        input=int(np.prod(x.shape)) * x.dtype.size,
        flops=tuple(batch * _segment_flops(model, s) for s in chain),
    )


_PROFILE_STEPS = 3


def _probe_run(step, records, device, n):
    """One probed step: (kept, need, recompute, transient, head), see `_Profile`."""
    records.clear()
    tf.config.experimental.reset_memory_stats(device)
    base = int(tf.config.experimental.get_memory_info(device)["current"])
    step()
    current = [records[("forward", i)][0] - base for i in range(n)]
    kept = [current[0]] + [current[i] - current[i - 1] for i in range(1, n)]
    forward_peak = [records[("forward", i)][1] - base for i in range(n)]
    # The probe on the gradient reaching segment i's output closes the stretch
    # in which segment i + 1's backward ran; no probe fires where no gradient is
    # needed (a stem without weights), so a stretch may cover several segments.
    closing = [("end",)] + [("backward", i) for i in range(n - 1)]
    backward_peak = []
    for i in range(n):
        j = i
        while closing[j] not in records:
            j -= 1
        backward_peak.append(records[closing[j]][1] - base)
    held = [
        records[("backward", i)][0] - base if ("backward", i) in records else None for i in range(n)
    ]
    return (
        kept,
        [max(f, b) for f, b in zip(forward_peak, backward_peak)],
        held,
        [p - c for p, c in zip(forward_peak, current)],
        [records[("backward", n - 1)][1] - base],
    )


def _elements(tensor) -> int:
    return int(math.prod(d for d in tensor.shape[1:]))


def _segment_flops(model, segment) -> int:
    """Forward FLOPs of one sample through `segment`: 2 per multiply-add of the
    layers with kernels (convolutions, dense, depthwise: output elements times
    the kernel's inputs per output), one per output element for the rest."""
    called = set(segment.layers)
    flops = 0
    for node in _ordered_nodes(model):
        layer = node.operation
        if layer.name not in called:
            continue
        out = sum(_elements(t) for t in node.outputs)
        channels = int(node.outputs[0].shape[-1] or 1)
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and len(kernel.shape) >= 2:
            macs = out * math.prod(kernel.shape) // channels
        else:
            inner = [
                v
                for v in getattr(layer, "trainable_weights", ())
                if v.name.endswith("kernel") and len(v.shape) >= 2
            ]
            macs = (out // channels) * sum(math.prod(v.shape) for v in inner)
        flops += 2 * macs + out
    return flops


# ---------------------------------------------------------------------------
# Predicting a choice's peak, and choosing.


def _runs(checkpointed):
    """[(first, last)] of the runs of consecutive True entries."""
    runs, start = [], None
    for i, flag in enumerate(list(checkpointed) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i - 1))
            start = None
    return runs


def _saving(profile, first, last) -> int:
    """Bytes freed for the rest of the step by recomputing segments first..last:
    what they kept, less their output, which stays for the next segment."""
    return sum(profile.kept[first : last + 1]) - profile.output[last]


def _run_need(profile, first, last) -> int:
    """The highest allocation while a checkpointed run first..last runs, before
    the savings of earlier runs: what its segments needed unmodified, or its
    recomputation, which starts when the gradient reaches its output (the
    later segments' weight gradients are held then, unlike in the forward pass)
    and adds the largest forward transient of its segments."""
    need = max(profile.need[first : last + 1])
    if profile.recompute[last] is None:
        return need
    # tf.recompute_grad recomputes from two copies of the run's input (an
    # identity, then an add that orders the recomputation after the gradient).
    copies = 2 * (profile.output[first - 1] if first else profile.input)
    return max(need, profile.recompute[last] + copies + max(profile.transient[first : last + 1]))


def _predict(profile, runs) -> int:
    """Predicted step peak (bytes beyond the step's start) when each run
    (first, last) of segments is one `Checkpoint`. A segment's stretch of the
    step holds what it held unmodified, less the savings of the runs that end
    before it (a checkpointed run's own activations are all back while its
    backward pass runs)."""
    peak, saved, r = 0, 0, 0
    n = len(profile.need)
    i = 0
    while i < n:
        if r < len(runs) and runs[r][0] == i:
            first, last = runs[r]
            peak = max(peak, _run_need(profile, first, last) - saved)
            saved += _saving(profile, first, last)
            r, i = r + 1, last + 1
        else:
            peak = max(peak, profile.need[i] - saved)
            i += 1
    return max(peak, profile.head - saved)


def _choose(profile, budget):
    """The runs with the least recomputed FLOPs whose predicted peak is within
    `budget` (bytes beyond the step's start), or None. Exact: a dynamic
    programme over the chain keeping, after each prefix, the Pareto front of
    (recomputed FLOPs, bytes saved so far)."""
    n = len(profile.need)
    # front[j]: states after deciding segments 0..j-1: (flops, saved, runs)
    front = [[] for _ in range(n + 1)]
    front[0] = [(0, 0, ())]
    for j in range(n):
        front[j] = _pareto(front[j])
        for flops, saved, runs in front[j]:
            if profile.need[j] - saved <= budget:
                front[j + 1].append((flops, saved, runs))
            worst, cost = 0, 0
            for k in range(j, n):
                worst = max(worst, profile.need[k])
                cost += profile.flops[k]
                if worst - saved > budget:
                    break  # every longer run needs at least as much
                gain = _saving(profile, j, k)
                if gain > 0 and _run_need(profile, j, k) - saved <= budget:
                    front[k + 1].append((flops + cost, saved + gain, runs + ((j, k),)))
    done = [s for s in _pareto(front[n]) if profile.head - s[1] <= budget]
    return min(done, key=lambda s: s[0])[2] if done else None


def _pareto(states):
    """States not beaten by another with no more FLOPs and at least as much saved."""
    kept, best = [], -1
    for state in sorted(states, key=lambda s: (s[0], -s[1])):
        if state[1] > best:
            kept.append(state)
            best = state[1]
    return kept


def _minimum(profile) -> int:
    """The least predicted step peak any choice reaches (bisection on the
    budget; each test is the largest saving reachable, greedy-exact on the
    chain)."""

    def feasible(budget):
        best = [-1] * (n + 1)
        best[0] = 0
        for j in range(n):
            saved = best[j]
            if saved < 0:
                continue
            if profile.need[j] - saved <= budget:
                best[j + 1] = max(best[j + 1], saved)
            worst = 0
            for k in range(j, n):
                worst = max(worst, profile.need[k])
                if worst - saved > budget:
                    break
                if _run_need(profile, j, k) - saved <= budget:
                    best[k + 1] = max(best[k + 1], saved + max(0, _saving(profile, j, k)))
        return best[n] >= 0 and profile.head - best[n] <= budget

    n = len(profile.need)
    low, high = 0, _predict(profile, [])
    while high - low > max(1, high // 2000):
        middle = (low + high) // 2
        if feasible(middle):
            high = middle
        else:
            low = middle
    return high


# ---------------------------------------------------------------------------
# The plan.


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


@dataclasses.dataclass
class Plan:
    """Which segments of a model to recompute, and what that is predicted to
    cost. Made by `plan`; `apply()` builds the model; `str(plan)` is a table.

    Byte counts are totals for training: `resident_bytes` (the model's
    variables, the optimizer's, the batch) plus the training step's peak.

    Attributes:
        model: the model planned for.
        segments: `segments(model)`.
        runs: (first, last) segment indices of each run recomputed as one
            `Checkpoint`.
        budget_bytes: the budget asked for (None: least memory).
        resident_bytes: variables of the model and optimizer, and the batch.
        batch_size: rows of the batch planned for.
        predicted_peak_bytes: predicted peak with this plan.
        plain_peak_bytes: measured peak of the unmodified model's step.
        minimum_peak_bytes: least predicted peak any plan reaches.
        recompute_fraction: predicted extra compute, as a fraction of the
            unmodified step's (forward and backward taken as 3 forward passes).
        checked: True when the three peaks are measured peaks of the steps
            (see the module docstring, step 4; `plan` always checks); False
            when they are predicted from the cut-by-cut measurement.
    """

    model: keras.Model
    segments: list
    runs: tuple
    budget_bytes: int | None
    resident_bytes: int
    batch_size: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    minimum_peak_bytes: int
    recompute_fraction: float
    profile: _Profile = dataclasses.field(repr=False)
    checked: bool = False
    check: object = dataclasses.field(default=None, repr=False, compare=False)
    # The unmodified step, checked, ran out of the device's memory:
    # plain_peak_bytes is then a lower bound.
    plain_out_of_memory: bool = False
    # The runs behind minimum_peak_bytes, once the least-memory candidates
    # were checked (for `with_budget`); None before.
    least_runs: tuple | None = dataclasses.field(default=None, repr=False)

    def with_budget(self, budget_bytes) -> "Plan":
        """The plan for another budget (None: least memory), from the same
        measurement (no step is run, except, for a checked plan, the XLA
        check of a choice not checked before)."""
        return _plan_for(
            self.model, self.segments, self.profile, self.resident_bytes,
            _check_budget(budget_bytes), self.batch_size, self.check, self.least_runs,
        )

    def predict(self, runs) -> int:
        """Predicted peak (total bytes) if `runs` were recomputed instead."""
        return self.resident_bytes + _predict(self.profile, list(runs))

    def groups(self):
        """(groups, checkpoint flags) for `rebuild`: each run recomputed, the
        segments between runs kept plain in one group each."""
        return _groups(self.runs, len(self.segments))

    def apply(self) -> Model:
        """A `kvram.Model` computing the same function as `model` on the
        **same variables** (the same weights, trained together; no copies),
        with each planned run under `kvram.layers.Checkpoint`."""
        return rebuild(self.model, *self.groups())

    def __str__(self) -> str:
        recomputed = {i for first, last in self.runs for i in range(first, last + 1)}
        p = self.profile
        rows = [
            f"kvram.remat plan for {self.model.name!r}: {len(self.segments)} segments, "
            f"{len(self.runs)} recomputed run(s)",
            f"{'seg':>4}  {'layers':<44} {'kept MiB':>9} {'output MiB':>10} {'GFLOP':>7}  recompute",
        ]
        for s in self.segments:
            names = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
            rows.append(
                f"{s.index:>4}  {names[:44]:<44} {_mib(p.kept[s.index]):>9} "
                f"{_mib(p.output[s.index]):>10} {p.flops[s.index] / 1e9:>7.2f}  "
                f"{'yes' if s.index in recomputed else ''}"
            )
        budget = "none (least memory)" if self.budget_bytes is None else f"{_mib(self.budget_bytes)} MiB"
        rows += [
            f"budget: {budget}; resident (variables, optimizer, batch): "
            f"{_mib(self.resident_bytes)} MiB",
            f"peak: plain {'out of memory, over ' if self.plain_out_of_memory else ''}"
            f"{_mib(self.plain_peak_bytes)} MiB, planned "
            f"{_mib(self.predicted_peak_bytes)} MiB, least possible "
            f"{_mib(self.minimum_peak_bytes)} MiB ("
            + ("each measured as an XLA-compiled step" if getattr(self.check, "jit", False)
               else "each measured as a step on the graph executor" if self.checked
               else "plain measured, the others predicted") + ")",
            f"extra compute: {100 * self.recompute_fraction:.1f}% of a training step (predicted)",
        ]
        return "\n".join(rows)


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


def _batch(sample_batch):
    if isinstance(sample_batch, (tuple, list)):
        if not 1 <= len(sample_batch) <= 3:
            raise ValueError(
                "sample_batch must be x or a tuple (x, y) or (x, y, sample_weight). "
                f"Received a {type(sample_batch).__name__} of {len(sample_batch)} items."
            )
        x, y = sample_batch[0], (sample_batch[1] if len(sample_batch) > 1 else None)
    else:
        x, y = sample_batch, None
    x = tf.convert_to_tensor(x)
    if x.shape.rank is None or x.shape.rank < 1 or x.shape[0] == 0:
        raise ValueError(f"sample_batch's x must have a batch dimension of >= 1 rows. Received shape {x.shape}.")
    if y is None:
        return x, None
    y = tf.convert_to_tensor(y)
    if y.shape.rank is None or y.shape.rank < 1 or y.shape[0] != x.shape[0]:
        raise ValueError(
            "sample_batch's x and y must hold the same rows, one target per sample. Received: x of "
            f"shape {tuple(x.shape)} ({x.shape[0]} rows), y of shape {tuple(y.shape)}"
            f"{f' ({y.shape[0]} rows)' if y.shape.rank else ''}."
        )
    return x, y


def _loss_function(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None:
        return lambda y, out: 0.5 * tf.reduce_mean(tf.square(tf.cast(out, "float32")))
    loss = keras.losses.get(loss)
    return lambda y, out: tf.reduce_mean(loss(y, tf.cast(out, "float32")))


def _optimizer_bytes(model, optimizer) -> int:
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if optimizer is None:
        return 0
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not optimizer.built:
        # A fresh copy of it, built on the model's variables to count its state.
        optimizer = optimizer.__class__.from_config(optimizer.get_config())
        optimizer.build(model.trainable_variables)
    return sum(_nbytes(v) for v in optimizer.variables)


def _nbytes(variable) -> int:
    return int(math.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def _check_budget(budget_bytes):
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
        raise ValueError(
            f"budget_bytes must be a positive number of bytes or None. Received: {budget_bytes!r}"
        )
    return int(budget_bytes)


def plan(model, sample_batch, budget_bytes=None, *, loss=None, optimizer=None, jit_compile="auto") -> Plan:
    """Chooses the segments of `model` to recompute so that training fits
    `budget_bytes`, with the least recomputation (see the module docstring).

    Runs measured training steps of `model` on `sample_batch` (on the default
    device: the GPU when there is one); its variables are read, not changed,
    except BatchNormalization's moving statistics and seed states, which
    advance as in training steps.

    Args:
        model: a functional Keras model (see `segments`).
        sample_batch: x, or (x, y), at the batch size that will be trained.
        budget_bytes: the most memory training may use on the device, counting
            the variables of the model and the optimizer, the batch and the
            step's peak. None: the least memory checkpointing can reach.
        loss: the training loss (a Keras loss name or callable); default the
            model's compiled loss, else a mean square of the outputs (the loss
            changes activation memory only by its own temporaries).
        optimizer: the optimizer (instance or name) whose state to count;
            default the model's compiled one, else none.
        jit_compile: whether training will run under XLA, so that the choice
            is checked by XLA-compiled steps rather than graph-executor steps
            (module docstring, step 4). "auto": on a GPU when Keras would
            compile the model with XLA (`Model.compile`'s default), else not.

    Returns:
        A `Plan`; `plan(...).apply()` is the model to train.

    Raises:
        TypeError, ValueError: a model that cannot be cut (see `segments`), a
            malformed batch, a `jit_compile` not True, False or "auto", or a
            budget that is not a positive number of bytes or below the least
            this model can reach (the message gives it).
    """
    model = _functional(model)
    chain = _chain(model)
    budget_bytes = _check_budget(budget_bytes)
    x, y = _batch(sample_batch)
    device = memory._device_name(None)
    loss_fn = _loss_function(model, loss)
    jit = _uses_xla(model, jit_compile, device)
    check = _step_check(model, chain, x, y, loss_fn, device, jit)
    check.jit = jit
    profile = _profile(model, chain, x, y, loss_fn, device)
    resident = (
        sum(_nbytes(v) for v in model.variables)
        + _optimizer_bytes(model, optimizer)
        + sum(int(np.prod(t.shape)) * t.dtype.size for t in (x, y) if t is not None)
    )
    return _plan_for(model, chain, profile, resident, budget_bytes, int(x.shape[0]), check)


def _uses_xla(model, jit_compile, device) -> bool:
    if jit_compile == "auto":
        from keras.src.trainers.trainer import model_supports_jit

        return device.startswith("GPU") and model_supports_jit(model)
    if not isinstance(jit_compile, bool):
        raise ValueError(f'jit_compile must be True, False or "auto". Received: {jit_compile!r}')
    return jit_compile


def _step_check(model, chain, x, y, loss_fn, device, jit):
    """A function of runs returning the measured peak (bytes beyond the step's
    start) of the training step of `model` with those runs recomputed, as it
    will train: XLA-compiled (`jit`; one run after the compiling one: XLA
    fixes its buffers at compile time) or on the graph executor (the highest
    of three runs: its op order varies). Results are kept by runs."""
    done = {}

    def check(runs):
        runs = tuple(runs)
        if runs not in done:
            trained = rebuild(model, *_groups(runs, len(chain))) if runs else model
            done[runs] = _step_peak(trained, x, y, loss_fn, device, jit)
        return done[runs]

    return check


class _OutOfMemory(int):
    """A checked step that ran out of the device's memory: the bytes free when
    it started (a lower bound of its peak)."""

    def __repr__(self) -> str:
        return f"_OutOfMemory(at least {int(self):,})"


def _step_peak(model, x, y, loss_fn, device, jit) -> int:
    try:
        return _step_peak_or_raise(model, x, y, loss_fn, device, jit)
    except tf.errors.ResourceExhaustedError:
        gc.collect()
        limit = memory.limit_bytes(device)
        return _OutOfMemory(max(1, limit - memory.current_bytes(device)) if limit else 1)


def _step_peak_or_raise(model, x, y, loss_fn, device, jit) -> int:
    variables = model.trainable_variables

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        # Returned, as a training step holds them until the optimizer applies them.
        return tape.gradient(loss, variables)

    gradients = step(x, y)  # traces (and compiles)
    del gradients
    memory.reset_peak(device)
    start = memory.current_bytes(device)
    for _ in range(1 if jit else _PROFILE_STEPS):
        gradients = None  # the previous step's are not held during the next
        gradients = step(x, y)
    peak = memory.peak_bytes(device) - start
    del gradients
    return peak


_CHECK_TRIES = 3

# The least-memory candidates besides the programme's choice at its least
# predicted peak: its choices at these multiples of that peak (fewer, longer
# or shorter runs), and the square-root split.
_LEAST_SLACK = (1.05, 1.1)
# Checked peaks within this fraction of the lowest count as equal: the one
# with the least recomputation is taken.
_LEAST_TIE = 0.02


def _sqrt_runs(n):
    """Chen et al. 2016's split: every segment recomputed, in runs of about
    sqrt(n) segments (only the runs' inputs are kept)."""
    k = max(1, round(math.sqrt(n)))
    return tuple((i, min(i + k, n) - 1) for i in range(0, n, k))


def _least_candidates(profile, low, every=True):
    """Choices that may reach the least peak: the programme's at its least
    predicted peak `low` (`_minimum`), and (`every`) its choices at
    `_LEAST_SLACK` times that and the square-root split (distinct, in that
    order)."""
    candidates = [tuple(_choose(profile, low))]
    if not every:
        return candidates
    for slack in _LEAST_SLACK:
        runs = _choose(profile, int(low * slack))
        if runs is not None:
            candidates.append(tuple(runs))
    candidates.append(_sqrt_runs(len(profile.need)))
    return list(dict.fromkeys(candidates))


def _spread_candidates(profile, low):
    """The programme's choices at `_SPREAD` of the way from the least
    predicted peak `low` to the plain step's."""
    high = _predict(profile, [])
    found = [_choose(profile, int(low + f * (high - low))) for f in _SPREAD]
    return [tuple(runs) for runs in found if runs]


def _one_run_fewer(candidates):
    """Each candidate with one of its runs (of two or more) left out."""
    return [r[:i] + r[i + 1:] for r in candidates if len(r) > 1 for i in range(len(r))]


# Where `_spread_candidates` takes the programme's choices, from the least
# predicted peak (0) to the plain step's (1).
_SPREAD = (0.1, 0.2, 0.35, 0.5)


def _least_runs(profile, check, candidates):
    """The least-memory runs: the candidate with the lowest checked peak (the
    least recomputation among those within `_LEAST_TIE` of it). The
    prediction errs most here, where most is recomputed (EfficientNetB0 on
    the CPU: the programme's choice checked at 0.40-0.55x of plain from run
    to run, its prediction 17-18% under its check in two runs), so which
    candidate is lowest changes with the model and the run."""
    # an _OutOfMemory (a lower bound) ranks after every measured peak
    peak = {runs: (isinstance(check(runs), _OutOfMemory), int(check(runs))) for runs in candidates}
    best = min(peak.values())
    if best[0]:
        return candidates[0]
    near = [r for r in candidates if not peak[r][0] and peak[r][1] <= best[1] * (1 + _LEAST_TIE)]
    return min(near, key=lambda r: _recomputed(profile, r))


def _recomputed(profile, runs) -> int:
    """Forward FLOPs recomputed by `runs`."""
    return sum(profile.flops[i] for a, b in runs for i in range(a, b + 1))


def _plan_for(model, chain, profile, resident, budget_bytes, batch, check=None, least_runs=None) -> Plan:
    low = _minimum(profile)
    candidates = _least_candidates(profile, low, every=check is not None)
    searched = least_runs is not None
    if least_runs is None:
        least_runs, searched = candidates[0], check is None
        # The candidates are checked when the least memory is asked for, or
        # when the programme's least-memory choice checks over the budget.
        if check is not None and (budget_bytes is None or check(least_runs) > budget_bytes - resident):
            least_runs, searched = _least_runs(profile, check, candidates), True
            # Checked steps need not follow the executor's prediction (XLA on
            # the CPU: with its last three segments recomputed, a residual
            # model peaked as high as without recomputation at 32 and 64 rows,
            # other choices at half): before saying nothing fits, the
            # programme's choices across the range are checked, then each
            # candidate with one of its runs left out.
            for more in (lambda _: _spread_candidates(profile, low), _one_run_fewer):
                if budget_bytes is None or check(least_runs) <= budget_bytes - resident:
                    break
                candidates = list(dict.fromkeys(candidates + more(candidates)))
                least_runs = _least_runs(profile, check, candidates)
    if check is None:
        plain, least = _predict(profile, []), low
        peak_of = lambda runs: _predict(profile, list(runs))  # noqa: E731
    else:
        plain, least = check(()), check(least_runs)
        peak_of = check
        if isinstance(least, _OutOfMemory):
            raise ValueError(
                f"At batch {batch}, the least-memory choice ({len(least_runs)} recomputed run(s)) "
                f"ran out of the device's memory when checked (it needs more than the "
                f"{_mib(least)} MiB that were free): nothing fits. Allowed: a smaller batch, "
                "mixed precision, or a device with more memory."
            )
    if budget_bytes is None:
        runs = least_runs
    else:
        if budget_bytes - resident < least:
            raise ValueError(
                f"budget_bytes={budget_bytes:,} ({_mib(budget_bytes)} MiB) is below the least "
                f"memory this model can train in at batch {batch}: {resident + least:,} bytes "
                f"({_mib(resident + least)} MiB: {_mib(resident)} MiB of variables, optimizer "
                f"state and batch, and a step peak of {_mib(least)} MiB with checkpointing). "
                "Allowed: budget_bytes >= that; or a smaller batch, or mixed precision."
            )
        if check is None:
            runs = tuple(_choose(profile, budget_bytes - resident))
        else:
            runs = _fit_checked(profile, check, budget_bytes - resident, plain, least, least_runs, candidates, low)
    total = sum(profile.flops)
    return Plan(
        model=model,
        segments=chain,
        runs=runs,
        budget_bytes=budget_bytes,
        resident_bytes=resident,
        batch_size=batch,
        predicted_peak_bytes=resident + peak_of(runs),
        plain_peak_bytes=resident + plain,
        minimum_peak_bytes=resident + least,
        least_runs=least_runs if searched else None,
        recompute_fraction=_recomputed(profile, runs) / (3 * total),
        profile=profile,
        checked=check is not None,
        check=check,
        plain_out_of_memory=isinstance(plain, _OutOfMemory),
    )


def _fit_checked(profile, check, target, plain, least, least_runs, candidates, low):
    """The runs with the least recomputation found whose checked peak is
    within `target`. The executor's prediction and XLA's measurement are
    mapped onto each other linearly between the plain step and the
    least-memory one; `_choose` is given `target` so mapped, then, while its
    choice checks over `target`, a budget lowered by the overshoot (mapped
    the same way) and `_LOWER_AT_LEAST` of the range more, the step doubling
    until `_choose` answers with runs not checked yet (a choice 0.1% over
    would otherwise be chosen again), up to `_CHECK_TRIES` checks. Falls back
    to the runs with the least recomputation whose checked peak is within
    `target` among those checked and the least-memory candidates
    (`_least_candidates`; the least-memory runs are one: `target` >= their
    checked peak)."""
    if plain <= target and not isinstance(plain, _OutOfMemory):
        return ()
    high = _predict(profile, [])
    if isinstance(plain, _OutOfMemory):
        # Its peak is unknown beyond the floor: the prediction's, scaled as the
        # least-memory step's measured peak is to its prediction.
        plain = max(int(plain), int(high * least / max(low, 1)))
    scale = (high - low) / max(plain - least, 1)
    budget = min(high, low + int((target - least) * scale))

    def fits(runs):  # an _OutOfMemory's floor is over the target too
        return check(runs) <= target and not isinstance(check(runs), _OutOfMemory)

    checked = []
    runs = _choose(profile, budget)
    while runs is not None and len(checked) < _CHECK_TRIES:
        checked.append(tuple(runs))
        if fits(checked[-1]):
            return checked[-1]
        step = max(1, int((check(checked[-1]) - target) * scale)) + int(_LOWER_AT_LEAST * (high - low))
        runs = None
        while runs is None and budget - step >= low:
            budget -= step
            runs = _choose(profile, budget)
            if runs is not None and tuple(runs) in checked:
                runs, step = None, 2 * step
    fitting = [r for r in list(candidates) + checked if fits(r)]
    return min(fitting, key=lambda r: _recomputed(profile, r), default=least_runs)


# How much further than the overshoot (a fraction of the range of predicted
# peaks) `_fit_checked` lowers the programme's budget after a choice checks
# over it: the prediction's error varies from choice to choice (MobileNetV3Small
# on the CPU: a choice 7.9 MiB over, lowered by that, checked 0.9 over; lowered
# by that, 0.03 over).
_LOWER_AT_LEAST = 0.01
