"""An optimizer whose state and float32 master weights live in host memory."""

from __future__ import annotations


import os
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from kvram import _checks, memory
from kvram.optimizers._wrapper import Wrapper, settings_given

# Optimizer state per parameter, in bytes, for Keras's optimizers (their `build`); kvram's
# AdamW8bit counts its own (`_state_bytes`). Used to refuse a host too small before anything
# is allocated; an optimizer not listed is counted as Adam's 8 and the message says so.
_STATE_BYTES = {
    "SGD": lambda o, n: 4 * n if o.momentum else 0,
    "Adam": lambda o, n: (12 if o.amsgrad else 8) * n,
    "AdamW": lambda o, n: (12 if o.amsgrad else 8) * n,
    "Adamax": lambda o, n: 8 * n,
    "Nadam": lambda o, n: 8 * n,
    "Lion": lambda o, n: 4 * n,
    "Adagrad": lambda o, n: 4 * n,
    "Adadelta": lambda o, n: 8 * n,
    "Ftrl": lambda o, n: 8 * n,
    "RMSprop": lambda o, n: (4 + (4 if o.momentum else 0) + (4 if o.centered else 0)) * n,
}
_ASSUMED = 8


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def available_host_bytes() -> int | None:
    """Memory the host can still give (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# TensorFlow's pinned host allocator (gpu_process_state.cc) holds at most this many MiB unless
# TF_GPU_HOST_MEM_LIMIT_IN_MB, read once as its runtime starts, says otherwise.
_PINNED_ENV, _PINNED_DEFAULT_MIB = "TF_GPU_HOST_MEM_LIMIT_IN_MB", 1 << 16


def pinned_host_limit(environ=None, pinned=None) -> int | None:
    """Bytes TensorFlow's host tensors may take where they are pinned (`kvram.speed.pin_host_memory`,
    which `import kvram` applies where there is a GPU): they then come from TensorFlow's pinned host
    allocator, 64 GiB unless TF_GPU_HOST_MEM_LIMIT_IN_MB says otherwise. None where host memory is
    not pinned (or no GPU is seen: the option then does nothing). The arguments stand in for the
    process's own state in tests."""
    if pinned is None:
        pinned = memory._host_memory_pinned() and bool(tf.config.list_physical_devices("GPU"))
    if not pinned:
        return None
    environ = os.environ if environ is None else environ
    try:
        mib = int(environ.get(_PINNED_ENV, _PINNED_DEFAULT_MIB))
    except ValueError:
        mib = _PINNED_DEFAULT_MIB  # TensorFlow logs the error and keeps its default
    return mib << 20


def _state_bytes(optimizer, shapes) -> tuple[int, bool]:
    """(bytes of `optimizer`'s state for variables of `shapes`, whether it is known exactly)."""
    counter = getattr(optimizer, "state_bytes", None)
    if callable(counter):  # kvram's AdamW8bit
        return int(sum(counter(shape) for shape in shapes)), True
    sizes = [int(np.prod(shape)) for shape in shapes]
    rule = _STATE_BYTES.get(type(optimizer).__name__)
    known = rule is not None and type(optimizer).__module__.startswith("keras")
    total = sum(rule(optimizer, n) if known else _ASSUMED * n for n in sizes)
    if (optimizer.gradient_accumulation_steps or 1) > 1:
        total += 4 * sum(sizes)  # the float32 sum of gradients
    return int(total), known


@keras.saving.register_keras_serializable(package="kvram")
class HostOffload(Wrapper, keras.optimizers.Optimizer):
    """Runs `inner_optimizer` on the host: its state, and a float32 master copy of every weight,
    live in host memory; the device keeps only the model's own weights (bfloat16 ones under a
    "bfloat16" dtype policy, so no float32 copy of a weight is on the device at all).

    Each `apply(gradients, weights)` copies the gradients to the host (in their own dtype: a
    bfloat16 gradient crosses as 2 bytes per value), updates the masters there with
    `inner_optimizer`'s own step (Keras's AdamW, kvram's AdamW8bit, ...: its weight decay,
    clipping and `gradient_accumulation_steps`, summed on the host in float32), and copies each
    master back cast to its weight's dtype. The update runs as TensorFlow CPU kernels on the host's
    cores, so the step holding it cannot be one XLA computation: `kvram.Model(host_offload=True)`
    compiles each forward and backward pass with XLA and leaves the update to TensorFlow's
    executor. A plain `keras.Model` must be compiled with `jit_compile=False` to use it (inside an XLA
    computation `apply` refuses, saying so).

    `build` refuses, before it allocates anything, a host whose free memory (Linux's MemAvailable)
    is smaller than the masters, the state, a step's gradient copies and the working copies of its
    update (`AdamW8bit.working_bytes`: of every weight, or with `groups` of the largest weight),
    with the numbers; and, where host memory is pinned (`kvram.speed.pin_host_memory`, which
    `import kvram` applies where there is a GPU), a need above TensorFlow's pinned allocator's
    limit (64 GiB unless TF_GPU_HOST_MEM_LIMIT_IN_MB is set before TensorFlow starts), saying what
    to set. The masters and the state are the optimizer's variables: `model.save` and TensorFlow
    checkpoints keep them, and loading puts them back bit for bit.

    With `jit_compile` (the default) the host's update is one XLA computation on the CPU: the
    optimizer's elementwise steps fused into one pass over the masters and state instead of one
    pass per TensorFlow op. On a 2-core CPU with AVX-512, an update of 16.8M parameters took 14.0 ms
    with XLA and 46.7 ms without for `AdamW`, 48.3 and 354 ms for `AdamW8bit` (2026-12-06,
    `python benchmarks/optimizers/host_update.py`; benchmarks/results/optimizers_host_update_cpu.json).

    With `groups=k`, the weights (in the model's order) are cut into k runs of about equal size,
    each updated once its gradients are on the host and the run before it is updated, the last run
    first, one weight after another (each weight's update its own computation, so that the update
    works in one weight's float32 copies at a time, not a run's; with kvram's `AdamW8bit` one
    computation, compiled once, serves the weights of one shape): the gradients of a model's last
    blocks are made first, so the host can update them, and copy their weights back, while the
    device computes the first blocks' gradients (not under a guard that skips non-finite steps,
    `kvram.Model(skip_nonfinite=True)`, or a `LossScaleOptimizer`: they wait for every gradient
    first). The step count moves once, after the last run. Not with what needs every gradient at
    once (`global_clipnorm`, `gradient_accumulation_steps`, `use_ema`). On an H200, a 0.62 B
    Llama-shaped model at 8 rows in 8 slices trained at 19,265 tokens/s with `groups=8` against
    16,230 without (2026-12-06, benchmarks/results/optimizers_offload_updates_h200.json).

    With `update_device` (a GPU), the update's arithmetic runs there instead, as TensorFlow ops: the
    gradients stay on the device, the masters and the state stay the host's variables, each read is
    copied to the device and each write copied back, and the weights are cast there. The host's
    cores then compute nothing; with `AdamW8bit` each update reads each master twice (weight decay,
    the cast) and writes it twice (decay, the step), and reads and writes the state once: 20 bytes per
    parameter cross (`tests/test_host_offload.py`); with `groups`, one run's at a time. Where the host's
    cores are the bound: a 16-core host updated 8 B parameters in 16.2 s with `AdamW8bit` and 6.2 s
    with `AdamW` (benchmarks/results/optimizers_host_update_threads_h100.json). On an H100 machine a
    0.98 B-parameter model with it trained under 6,900 tokens/s (its 16 timed steps did not end within
    its time limit: benchmarks/results/optimizers_offload_update_gpu_1b_h100.json).

    With `block_inputs="host"`, under `kvram.Model(host_offload=True)` with XLA, each block of
    `kvram.layers.Checkpoint(row_chunks=k)` (k >= 1) copies its input to `host` after its forward pass
    and back once its outputs' gradients arrive, so the device holds no block's input in between
    (the weights and the input a block is computing on remain): for a decoder, rows x sequence x
    hidden values a block, 128 MiB in bfloat16 for Llama-3-8B's width at 8 rows of 2,048 tokens, 4 GiB
    over its 32 blocks. Each crosses twice a step; training is unchanged (`tests/test_host_offload.py`).
    What it costs in time on a GPU is not measured. A step that keeps no block's input there (no such
    block, no XLA, `micro_batch_size`, a plain `keras.Model`) is refused as it is traced, before any
    weight changes; so is one whose block inputs, gradient copies and update's working copies the
    host has no room for beside the masters and state (MemAvailable then, or the pinned limit).

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` that computes the update.
        host: the device holding masters and state ("/CPU:0").
        jit_compile: compile the host's update with XLA (True) or run it as TensorFlow ops; with
            `update_device`, the update runs as TensorFlow ops on that device and this is not read.
        groups: the runs of weights updated one by one (1: one update of every weight).
        update_device: None (the host computes the update), or the device that does (above).
        block_inputs: "device" (the default) or "host": where row-chunked blocks keep their
            inputs between their forward and backward passes (above).
    """

    def __init__(self, inner_optimizer, host="/CPU:0", jit_compile=True, groups=1, name=None, update_device=None,
                 block_inputs="device"):
        inner_optimizer = keras.optimizers.get(inner_optimizer)
        if isinstance(inner_optimizer, (HostOffload, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                f"HostOffload wraps the optimizer that computes the update, not a {type(inner_optimizer).__name__}. "
                "Allowed: HostOffload(keras.optimizers.AdamW(...)), wrapped in a LossScaleOptimizer if needed.")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive int. Received: groups={groups!r}")
        if groups > 1:
            given = settings_given(inner_optimizer, {"global_clipnorm": None, "use_ema": False})
            if given:
                raise ValueError(f"HostOffload(groups={groups}) updates each run of weights from its own gradients, "
                                 f"so it cannot wrap an optimizer with {', '.join(given)}, which needs every gradient "
                                 "at once. Allowed: groups=1, or clipnorm/clipvalue (per weight).")
        if _named_device(host, "CPU") is None:
            raise ValueError(f"host must name one of this machine's CPUs. Received: host={host!r}. "
                             f"Allowed: {', '.join(d.name for d in tf.config.list_logical_devices('CPU'))}")
        if update_device is not None and _named_device(update_device) is None:
            raise ValueError(f"update_device must be None or name one of this machine's devices. Received: "
                             f"update_device={update_device!r}. Allowed: None, "
                             f"{', '.join(d.name for d in tf.config.list_logical_devices())}")
        if block_inputs not in ("device", "host"):
            raise ValueError(f'block_inputs must be "device" or "host". Received: block_inputs={block_inputs!r}')
        super().__init__(inner_optimizer, name=name or "host_offload")
        self.host = host
        self.block_inputs = block_inputs
        self.kept_block_inputs = 0  # the blocks whose inputs the step being traced keeps here
        self.kept_block_input_bytes = 0  # and those inputs' bytes
        self.update_device = update_device
        self.jit_compile = bool(jit_compile)
        self.groups = groups
        self.masters = []
        self._updates = {}
        # _weight_update's map from TensorFlow's variables to Keras's: a plain dict, not Keras's tracked
        # one, which would add the masters and state put in it to this optimizer's variables again
        object.__setattr__(self, "_keras_of", {})

    def required_host_bytes(self, var_list) -> tuple[int, bool]:
        """(bytes the host needs for `var_list`: float32 masters, the optimizer's state, one
        step's gradient copies, in the weights' dtype, and the working copies of the update of
        every weight, or with `groups` of the largest weight (neither with `update_device`);
        whether the state is known exactly)."""
        masters, copies, state, working, exact = self._host_parts(var_list)
        return masters + copies + state + working, exact

    def _host_parts(self, var_list) -> tuple[int, int, int, int, bool]:
        """(masters, gradient copies, state, update's working copies) bytes of `var_list`, and
        whether the state's is exact."""
        shapes = [tuple(v.shape) for v in var_list]
        sizes = [int(np.prod(shape)) for shape in shapes]
        state, exact = _state_bytes(self.inner_optimizer, shapes)
        masters = 4 * sum(sizes)
        # with update_device the gradients stay on the device, where the update works
        copies = 0 if self.update_device else sum(n * tf.as_dtype(v.dtype).size for n, v in zip(sizes, var_list))
        # one update of every weight, or (groups) one weight's update at a time
        parts = [shapes] if self.groups == 1 else [[shape] for shape in shapes]
        working = 0 if self.update_device or not shapes else max(
            _working_bytes(self.inner_optimizer, part, self.jit_compile) for part in parts)
        return masters, copies, state, working, exact

    def _check_host(self, var_list) -> None:
        masters, copies, state, working, exact = self._host_parts(var_list)
        need, free, pinned = masters + copies + state + working, available_host_bytes(), pinned_host_limit()
        how = "" if exact else f", counted as Adam's {_ASSUMED} bytes per parameter"
        name = type(self.inner_optimizer).__name__
        what = (f"HostOffload needs {_gib(need)} of host memory for {masters // 4:,} parameters: float32 master "
                f"weights ({_gib(masters)}), a step's gradients ({_gib(copies)}), {name}'s state "
                f"({_gib(state)}{how}) and its update's working copies ({_gib(working)}, "
                f"{'for every weight at once' if self.groups == 1 else 'for the largest weight'}); ")
        _refuse_without_room(what, need, free, need, pinned, "Nothing was allocated.",
                             "Free host memory, use a smaller state (kvram.optimizers.AdamW8bit: about 2 bytes per "
                             "parameter), or train fewer weights.")

    def _check_step_host(self, variables) -> None:
        """Refuses, as the step is traced (before it runs), a host without room for what the step
        adds to the masters and state `build` allocated: the block inputs it keeps there, its
        gradient copies and its update's working copies; with the numbers."""
        masters, copies, state, working, _ = self._host_parts(variables)
        kept = self.kept_block_input_bytes
        step, free, pinned = kept + copies + working, available_host_bytes(), pinned_host_limit()
        what = (f'HostOffload(block_inputs="host"): this step keeps {self.kept_block_inputs} blocks\' inputs on the '
                f"host ({_gib(kept)}); with a step's gradients ({_gib(copies)}) and its update's working copies "
                f"({_gib(working)}) it needs {_gib(step)} beyond the masters and state ({_gib(masters + state)}, "
                "allocated); ")
        _refuse_without_room(what, step, free, masters + state + step, pinned, "No step has run.",
                             'Allowed: fewer rows a step, or block_inputs="device".')

    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self._check_host(var_list)
        with tf.device(self.host):
            masters = []
            for variable in var_list:
                value = tf.cast(tf.convert_to_tensor(variable), tf.float32)
                masters.append(self.add_variable(
                    shape=variable.shape, dtype="float32",
                    initializer=lambda shape, dtype, value=value: tf.identity(value),
                    name=variable.path.replace("/", "_") + "_master"))
            inner = self.inner_optimizer
            _scalars_to_host(inner, self.host)
            inner.build(masters)
        self._decay_as(inner, var_list, masters)
        self.masters = masters
        self._master_of = {self._var_key(v): m for v, m in zip(var_list, masters)}
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.src.backend.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                "HostOffload's update runs on the host, so it cannot sit inside the step's XLA computation "
                "(jit_compile=True, Keras's default on a GPU). Allowed: kvram.Model(host_offload=True), which "
                "compiles the forward and backward passes alone, or compile(..., jit_compile=False).")
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            raise ValueError(f"HostOffload updates one host copy of the weights, so it cannot run over "
                             f"{context.num_replicas_in_sync} replicas. Allowed: one device.")
        if self.block_inputs == "host" and not self.kept_block_inputs:
            raise ValueError(
                'block_inputs="host" keeps the inputs of kvram.layers.Checkpoint(row_chunks=k) blocks (k >= 1) '
                "on the host, in the step of kvram.Model(host_offload=True) compiled with XLA (jit_compile), "
                "without micro_batch_size; this step kept none. Allowed: block_inputs=\"device\", or such a model.")
        if self.block_inputs == "host":
            self._check_step_host(variables)
            # counted again as the next step is traced: one that keeps none (a plain keras.Model given
            # this optimizer after a kvram.Model) is refused, not run on this count
            self.kept_block_inputs = self.kept_block_input_bytes = 0
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        masters = [self._master_of[self._var_key(v)] for _, v in pairs]
        whole = self.groups == 1
        runs = [range(len(pairs))] if whole else reversed(_runs([int(np.prod(v.shape)) for _, v in pairs], self.groups))
        values = []
        for run in runs:
            with tf.device(self.update_device or self.host):
                # on the host, copies; on update_device, the gradients where they are
                grads = [pairs[i][0] if self.update_device else _copy(pairs[i][0]) for i in run]
                # Each run's reads of its masters and state wait for its gradients and for the run
                # before it: without, TensorFlow's executor reads (on update_device: copies there)
                # every run's at the step's start, all of them at once.
                if whole:
                    with tf.control_dependencies(_made(grads) + values):
                        values = self._host_update(masters, tuple(v.dtype for _, v in pairs))(grads)
                else:
                    # one weight at a time, each its own computation after the one before: the
                    # update's working copies are one weight's, not the run's
                    after, values = _made(grads) + values, []
                    for i, gradient in zip(run, grads):
                        with tf.control_dependencies(after):
                            values += self._weight_update(masters[i], pairs[i][1].dtype)(gradient)
                        after = values[-1:]
            for i, value in zip(run, values):
                pairs[i][1].assign(value)  # cast where updated: from the host, bfloat16 crosses as 2 bytes
        if not whole:
            with tf.device(self.host):
                self.inner_optimizer.iterations.assign_add(1)  # after every run's update (they read it)

    def _host_update(self, masters, dtypes, whole=True):
        """`grads -> weights`: the inner optimizer's step on `masters`, and each master cast to its
        weight's dtype; one XLA computation on the host with `jit_compile`, TensorFlow ops with
        `update_device` (the caller places them there). `whole=False`: a run of the weights
        (`groups`), the step count left as it is."""
        key = (tuple(id(m) for m in masters), dtypes, whole)
        function = self._updates.get(key)
        if function is None:
            inner = self.inner_optimizer
            if whole:
                def function(grads):
                    inner.apply([_float32(g) for g in grads], masters)
                    return [tf.cast(m, dtype) for m, dtype in zip(masters, dtypes)]
            else:
                def function(grads):
                    return self._run_update(grads, masters, dtypes)

            if self.jit_compile and self.update_device is None:
                function = tf.function(function, jit_compile=True, autograph=False)
            self._updates[key] = function
        return function

    def _run_update(self, grads, masters, dtypes) -> list:
        """Keras's `Optimizer.apply` for a run of `masters` (`groups`), but for the step count; each
        master cast to its weight's dtype."""
        inner = self.inner_optimizer
        learning_rate = inner._get_current_learning_rate()
        grads = inner._clip_gradients([_float32(g) for g in grads])
        inner._apply_weight_decay(masters)
        for gradient, master in zip(grads, masters):
            inner.update_step(gradient, master, learning_rate)
        return [tf.cast(m, dtype) for m, dtype in zip(masters, dtypes)]

    def _weight_update(self, master, dtype):
        """`gradient -> [weight]` for one weight (`groups >= 2`). One XLA computation on the host for every
        weight of one shape and dtype where the inner optimizer says which of its variables belong to
        each (`shared_update`, kvram's AdamW8bit): traced and compiled once, with the weight and those
        variables as its arguments, not once a weight (Llama-3-8B's shape: 291 weights of 8 shapes);
        otherwise the weight's own (`_host_update`)."""
        shared = getattr(self.inner_optimizer, "shared_update", None)
        found = shared(master) if shared is not None and self.jit_compile and self.update_device is None else None
        if found is None:
            function = self._host_update([master], (dtype,), whole=False)
            return lambda gradient: function([gradient])
        key, own = found
        key = ("shared", key, dtype)
        # TensorFlow's variables under Keras's, as arguments: where the trace reaches them through Keras's
        # (update_step's lookups of this master's state), it finds the arguments, in every call
        self._keras_of.update({id(v._value): v for v in (master, *own)})
        function = self._updates.get(key)
        if function is None:
            def update(gradient, value, own_values):
                del own_values  # reached through the inner optimizer's lookups, as arguments
                # the Keras master of the call being traced
                return self._run_update([gradient], [self._keras_of[id(value)]], (dtype,))

            function = self._updates[key] = tf.function(update, jit_compile=True, autograph=False)
        return lambda gradient: function(gradient, master._value, [v._value for v in own])

    def to_host(self, grads) -> list:
        """`grads` copied to the host, each in its own dtype (`apply` computes in float32). A step that
        calls this as soon as its gradients are made lets each device gradient go once copied:
        what then needs every gradient (the non-finite guard, clipping, `apply`) reads the copies.
        With `update_device`, the gradients as they are: the update reads them there."""
        if self.update_device is not None:
            return list(grads)
        with tf.device(self.host):
            return [None if g is None else _copy(g) for g in grads]

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(self.masters)
        for variable, master in zip(var_list, self.masters):
            variable.assign(tf.cast(master, variable.dtype))

    def get_config(self):
        return {**super().get_config(), "host": self.host, "jit_compile": self.jit_compile, "groups": self.groups,
                "update_device": self.update_device, "block_inputs": self.block_inputs}


def pinned_setting(need: int) -> str:
    """What to set for TensorFlow's pinned host allocator to hold `need` bytes."""
    return f"{_PINNED_ENV} (MiB) above {-(-need // 2**20)}"


def _refuse_without_room(what, need, free, pinned_need, pinned, done, allowed) -> None:
    """Raises MemoryError (`what`, why, `done`, what to do) where `need` is over the host's `free`
    memory (MemAvailable), or `pinned_need` over the pinned allocator's limit `pinned`; None: not known."""
    if free is not None and need > free:
        raise MemoryError(f"{what}the host has {_gib(free)} free (MemAvailable). {done} {allowed}")
    if pinned is not None and pinned_need > pinned:
        raise MemoryError(
            f"{what}host memory is pinned (kvram.speed.pin_host_memory) and TensorFlow's pinned allocator "
            f"holds at most {_gib(pinned)} ({_PINNED_ENV}, 64 GiB unless set). {done} Set "
            f"{pinned_setting(pinned_need)}, with room for the program's other host tensors, before TensorFlow "
            "starts (its first operation), or KVRAM_PIN_HOST_MEMORY=0 (pageable host memory: slower copies).")


def _named_device(name, device_type=None) -> str | None:
    """The logical device `name` names (`kvram._checks.logical_device`), or None where this machine
    has none (of `device_type`, where given)."""
    try:
        found = _checks.logical_device(name)
    except (TypeError, ValueError):
        return None
    return found if device_type in (None, tf.DeviceSpec.from_string(found).device_type) else None


def _working_bytes(optimizer, shapes, jit_compile: bool) -> int:
    """Bytes `optimizer`'s update of weights of `shapes` works in beyond the weights, gradients and
    state: kvram's AdamW8bit counts its own (`working_bytes`); Keras's optimizers update in place as
    one XLA computation, and take up to 6 bytes per parameter as TensorFlow ops on a 2-core CPU
    (benchmarks/results/optimizers_host_update_cpu.json: AdamW), counted as 8."""
    counter = getattr(optimizer, "working_bytes", None)
    if callable(counter):
        return int(sum(counter(shape, jit_compile) for shape in shapes))
    return 0 if jit_compile else 8 * sum(int(np.prod(shape)) for shape in shapes)


def _runs(sizes, groups: int) -> list:
    """Consecutive index runs of `sizes`, at most `groups` of them, each of about 1/groups of the total."""
    total, runs, run, done = sum(sizes), [], [], 0
    for i, size in enumerate(sizes):
        run.append(i)
        done += size
        if len(runs) < groups - 1 and done >= total * (len(runs) + 1) / groups:
            runs.append(run)
            run = []
    return runs + [run] if run else runs


def _scalars_to_host(optimizer, host) -> None:
    """Re-creates `optimizer`'s step count and learning rate on `host` (it made them where it was
    constructed: on a GPU by default), so that its update reads no value across devices."""
    if not tf.executing_eagerly():
        return
    want = tf.DeviceSpec.from_string(host)
    for attribute in ("_iterations", "_learning_rate"):
        old = getattr(optimizer, attribute, None)
        if not isinstance(old, keras.Variable):
            continue  # a schedule
        where = tf.DeviceSpec.from_string(old.value.device)
        if (where.device_type, where.device_index) == (want.device_type, want.device_index or 0):
            continue
        with tf.device(host), keras.name_scope(optimizer.name, caller=optimizer):
            new = keras.Variable(tf.identity(old.value), name=old.name, dtype=old.dtype, trainable=False,
                                 aggregation=old.aggregation)
        index = next(i for i, v in enumerate(optimizer._variables) if v is old)
        optimizer._variables[index] = new
        setattr(optimizer, attribute, new)


def update_rate(optimizer, parameters: int = 2**22, updates: int = 3, jit_compile: bool = True) -> float:
    """Parameters per second this host's cores update with a fresh copy of `optimizer` (a name or an
    instance, left as it is): `parameters` float32 values in 4 variables, `updates` timed updates
    after 2 untimed ones, as one XLA computation on the CPU with `jit_compile`."""
    update, wait, count = sample_update(optimizer, parameters, jit_compile)
    started = time.perf_counter()
    for _ in range(updates):
        update()
    wait()  # for the last update
    return count * updates / (time.perf_counter() - started)


def sample_update(optimizer, parameters: int = 2**22, jit_compile: bool = True):
    """A fresh copy of `optimizer` (a name or an instance, left as it is) over `parameters` float32
    values in 4 variables on the host, after 2 updates: `(update, wait, count)`, `update()` running
    one more (one XLA computation on the CPU with `jit_compile`), `wait()` until the last has ended,
    `count` the values updated."""
    optimizer = keras.optimizers.get(optimizer)
    rng = np.random.default_rng(0)
    shape = (max(1, parameters // 4 // 1024), 1024)
    with tf.device("/CPU:0"):
        # its step count and learning rate made on the host too: the host's XLA update cannot read
        # a variable on another device (the default one: a GPU)
        optimizer = optimizer.__class__.from_config(optimizer.get_config())
        variables = [keras.Variable(rng.normal(size=shape).astype("float32")) for _ in range(4)]
        gradients = [tf.constant(rng.normal(size=shape).astype("float32") * 1e-3) for _ in range(4)]
        optimizer.build(variables)
        step = tf.function(lambda g: optimizer.apply(g, variables), jit_compile=jit_compile)

    def update():
        with tf.device("/CPU:0"):
            step(gradients)

    def wait():
        variables[0].numpy()

    for _ in range(2):
        update()
    wait()
    return update, wait, 4 * shape[0] * shape[1]


def _copy(gradient):
    """`gradient` where the caller's device scope says: an identity, so that the copy is made there."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(gradient.values), tf.identity(gradient.indices), gradient.dense_shape)
    return tf.identity(gradient)


def _made(gradients) -> list:
    """`gradients`' tensors, for a control dependency."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]


def _float32(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(gradient.values, tf.float32), gradient.indices, gradient.dense_shape)
    return tf.cast(gradient, tf.float32)
