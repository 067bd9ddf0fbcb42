"""Whether a step's parts compile with XLA one by one: `compiled_blocks()`, which
`kvram.Model(host_offload=True)`'s step enters, and what `Checkpoint` and the fused head read."""

from __future__ import annotations

import contextlib
import json
import threading
import types

import keras
import numpy as np
import tensorflow as tf
from keras import tree

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
    inputs on the host, `kept_bytes`, those inputs' size, and `functions`, the compiled passes
    blocks of one kind share (`compiled`)."""

    def __init__(self):
        self.kept_inputs = 0
        self.kept_bytes = 0
        self.functions = {}


def share_key(layer, variables, inputs, call, *settings):
    """What makes the compiled passes of two blocks traced within `compiled_blocks()` one: the class of
    each layer in the block and what it was made with (its config where it has one, and its attributes
    that are plain values, functions, dtype policies or arrays; a layer's name as its place in the
    block), its `variables`' shapes and dtypes (`block_variables`), the inputs' shapes and dtypes, what else its call is
    given (`call`: args and kwargs, tensors aside) and `settings`; None where these cannot be told
    apart (a value whose text names an object, a function closing over one, a layer from outside
    Keras, KerasHub and kvram without a config). What else a trace reaches (a tensor made outside it)
    `Shared.compiled` finds as it is traced."""
    layers = list(layer._flatten_layers(include_self=True, recursive=True))
    places = {sub.name: f"#{i}" for i, sub in enumerate(layers)}

    def plain(value):
        """`value` as a key holds it, or `_OTHER` (a layer, a variable, Keras's own bookkeeping)."""
        if isinstance(value, str):
            return places.get(value, value)
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, (tuple, list, dict)):
            values = {str(k): plain(v) for k, v in value.items()} if isinstance(value, dict) else [
                plain(v) for v in value]
            return _OTHER if any(v is _OTHER for v in (values.values() if isinstance(value, dict) else values)) else values
        if isinstance(value, types.FunctionType):  # its code, and what it closes over, in the key
            code, cells = value.__code__, [c.cell_contents for c in value.__closure__ or ()]
            parts = [plain(value.__defaults__ or ()), plain(cells)]
            if any(part is _OTHER for part in parts):
                raise ValueError(f"{value!r} closes over an object")
            return [_qualified(value), hash((code.co_code, code.co_consts)), *parts]
        if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__") and not hasattr(value, "__self__"):
            return _qualified(value)
        if isinstance(value, keras.DTypePolicy):
            return value.name
        if isinstance(value, np.ndarray):
            return [value.shape, str(value.dtype), hash(value.tobytes())]
        return _OTHER

    try:
        parts = [plain(tree.map_structure(lambda a: None if tf.is_tensor(a) else a, call))]
        for sub in layers:
            try:
                config = plain({k: v for k, v in sub.get_config().items() if k != "name"})
            except (AttributeError, NotImplementedError, TypeError):  # KerasHub's Llama decoder: AttributeError
                if type(sub).__module__.split(".")[0] not in ("keras", "keras_hub", "kvram"):
                    return None  # a layer of its own whose config Keras cannot give: what makes it is not known
                config = None
            # not a method of its class Keras wrapped in place (build, quantize): the class says it
            attributes = sorted((k, plain(v)) for k, v in vars(sub).items()
                                if k not in _NAMES and not (callable(v) and hasattr(type(sub), k)))
            parts.append([_qualified(type(sub)), config, [(k, v) for k, v in attributes if v is not _OTHER]])
        text = json.dumps(parts, sort_keys=True, default=lambda value: _no_object(repr(value)))
    except ValueError:
        return None
    return (text, tuple((tuple(v.shape), str(v.dtype), v.trainable) for v in variables),
            tuple((tuple(t.shape), t.dtype.name) for t in inputs), settings)


_NAMES = ("name", "_name", "_path", "_parent_path")
_OTHER = object()


def _qualified(value) -> str:
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"


def _no_object(text: str) -> str:
    if " at 0x" in text:  # an object's address: not the same for two blocks that are alike
        raise ValueError(text)
    return text


def block_variables(layer) -> list | None:
    """Every variable `layer` (and the layers in it) holds, its seed generators' states included, as
    TensorFlow's variables, in the block's structure's order (each layer's in the order of its place,
    `_flatten_layers`): the arguments of a compiled pass that blocks share (`compiled`). None where
    that walk does not find what Keras says the layer holds."""
    from kvram._state import mutable_state

    found = {}
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        for v in [*sub._trainable_variables, *sub._non_trainable_variables,
                  *(g.state for g in getattr(sub, "_seed_generators", []))]:
            found.setdefault(id(v), v)
    if set(found) != {id(v) for v in [*layer.variables, *mutable_state(layer)]}:
        return None
    return [getattr(v, "_value", v) for v in found.values()]


def sharing(layer, inputs, call, *settings):
    """A `Shared` for a block traced within `compiled_blocks()` (`share_key`), or None."""
    variables = block_variables(layer)
    key = None if variables is None else share_key(layer, variables, inputs, call, *settings)
    return None if key is None else Shared(key, variables, _compiling.record.functions)


class Shared:
    """The compiled passes of a block shared with the blocks alike traced within one
    `compiled_blocks()` (`share_key`): `own`, its variables, are their last argument."""

    def __init__(self, key, own, functions):
        self.key, self.own, self.functions = key, own, functions

    def compiled(self, python_function, *part):
        """`python_function`, compiled with XLA by the first block of this key (for this `part` of the
        step), traced once. As arguments, its variables are what the trace reaches through the first
        block's layer, in every call. Each call is checked as it is traced (once the step is traced,
        nothing is): a trace that captured anything instead (a variable the layer reaches that is not
        its own, as Keras's global seed generator, or a tensor made outside it; the first block's
        variables, where a later call traced the function again) is not this call's to share, and it
        and each later block of that key compile their own."""
        key, functions = (self.key, *part), self.functions
        fresh = tf.function(python_function, jit_compile=True, autograph=False)
        if functions.get(key, fresh) is None:
            return fresh
        shared = functions.setdefault(key, fresh)
        functions.setdefault((self.key, "owner"), self.own)  # the forward pass's: its first

        def checked(*args):
            if shared.get_concrete_function(*args).captured_inputs:
                functions[key] = None
                return fresh(*args)
            return shared(*args)

        return checked

    def variables(self, given) -> list:
        """The variables a block's gradient is asked for (`given`, by `tf.custom_gradient`) that it
        computes: its own in the order of `own` (TensorFlow gives them by name: dense_10 before dense_9),
        then any other, but not the first block's where this is another (TensorFlow says a pass
        traced by one block reads that block's variables, in every call)."""
        owner = self.functions.get((self.key, "owner"))
        foreign = [] if owner is None or owner is self.own else owner
        mine = [o for o in self.own if any(v is o for v in given)]
        return mine + [v for v in given if not any(v is o for o in [*self.own, *foreign])]

    def carried(self, flags: list) -> None:
        """A `Checkpoint`'s `flags` (whether its block's outputs carried logits) as the first block of
        this key left them: a block whose passes were traced for another traces none, and says nothing."""
        flags[:] = self.functions.setdefault((self.key, "logits"), list(flags))


def compiled(python_function, share=None, *part):
    """`python_function` compiled with XLA: the one blocks alike share (`Shared.compiled`) where `share`."""
    if share is None:
        return tf.function(python_function, jit_compile=True, autograph=False)
    return share.compiled(python_function, *part)


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
