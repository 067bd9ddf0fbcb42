"""`kvram.Model`: a Keras model whose training step adds loss scaling, gradient
accumulation, micro-batching, clipping and a guard against non-finite
gradients. The step itself is `_step`'s; the fit loop's function, where it
slices batches or recovers from out-of-memory errors, `_train_function`'s."""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import tree
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.saving import object_registration
from keras.src.trainers.data_adapters import data_adapter_utils

from kvram import _checks, data, optimizers, precision
from kvram.training import _batch_statistics, _execution, _step, _train_function
from kvram.training._skip_watch import SkipWatch


# Batches `fit()` copies ahead to the GPU by default (`Model`'s prefetch_to_gpu):
# they stay on the GPU beside the step's own, and kvram's memory plans count them.
PREFETCH_TO_GPU = 2

_KVRAM_ARGS = (
    "accumulation_steps",
    "micro_batch_size",
    "clip_global_norm",
    "skip_nonfinite",
    "update_in_backward",
    "host_offload",
    "max_consecutive_skips",
    "prefetch_to_gpu",
)


@keras.saving.register_keras_serializable(package="kvram")
class Model(keras.Model):
    """A `keras.Model` with a memory-aware, guarded training step (TensorFlow backend).

    Use it like `keras.Model`: subclass it, or build it functionally with
    `kvram.Model(inputs, outputs)`. Its `train_step` is Keras's own
    (`TensorFlowTrainer.train_step`) plus:

    - Loss scaling: the loss goes through `optimizer.scale_loss` and the
      gradients through `optimizer.apply`, so under `mixed_float16` Keras's
      `LossScaleOptimizer` (put in place by `compile()`) scales and unscales.
    - `accumulation_steps=N`: weights are updated every N batches with the mean of
      their gradients, so N batches of b train like one batch of N*b at the memory
      of b. This is the optimizer's own `gradient_accumulation_steps`, set on the
      inner optimizer when a `LossScaleOptimizer` wraps it. A skipped step does not
      count towards the N.
    - `micro_batch_size=m`: each batch from the data is still one optimisation
      step, but its forward and backward passes run over slices of at most m
      rows, one after the other, and their gradients are summed with weights
      rows/batch (so a short last slice counts for what it holds). Activation
      memory then follows m while the update equals the whole batch's; the
      running sum costs one more gradient-sized buffer. The loss must be a
      mean over the batch (Keras's default reduction). What differs from one
      pass over the batch: BatchNormalization normalises each slice with that
      slice's statistics and updates its moving statistics once per slice, and
      loss terms that are not per-sample means (e.g. activity regularisers summed
      over the batch) are averaged over slices. `AdaptiveBatchSize` changes m
      during `fit()`.
    - `clip_global_norm`: the (accumulated, unscaled) gradient is clipped to this
      global norm, through the optimizer's own `global_clipnorm`. Under a
      multi-replica `tf.distribute` strategy the replicas' summed gradient is
      clipped (Keras alone would clip each replica's share).
    - `skip_nonfinite=True`: a step whose gradients are not all finite changes no
      weight and no optimizer variable, and is counted in the `skipped_steps` log
      entry (a running total). Under `mixed_float16` the `LossScaleOptimizer`
      does the skip itself and halves its loss scale, the one optimizer variable
      that must change for dynamic loss scaling to work; the skip is counted the
      same way.
    - `max_consecutive_skips=20`: a run of skipped steps that does not end is a
      broken run, not bad luck (with all-NaN inputs every step is skipped, for
      ever). After 5 skipped steps in a row a warning says so; at this many
      `fit()` stops with a `FloatingPointError` naming the likely cause: NaN/Inf
      in the inputs (the skipped batches are checked, at no cost to the others),
      float16 overflow with the loss scale fallen below 1, or a computation that
      diverged (the loss before the run, the learning rate). Weights and
      optimizer state are as after the last good step. Under mixed_float16 a
      healthy start skips a few steps while the loss scale drops from 2**15;
      20 leaves room for 15 halvings.
      The run is counted after each call into the compiled step: with 16 batches
      a call (`steps_per_execution="auto"`, below) fit stops at the end of the
      first call that reaches the limit (at step 32 for 20, weights as before the
      run); compile with `steps_per_execution=1` to stop at the step itself.
    - `compile(..., steps_per_execution="auto")`, the default here (Keras's is 1):
      `fit`, `evaluate` and `predict` run 16 batches per call into the compiled
      step, so the GPU does not wait for Python between batches (ResNet50 on an
      H200: 1.05x), and one batch per call where a callback passed to that call
      defines a batch hook (`on_train_batch_end`, ...: it then sees every batch),
      under `AdaptiveBatchSize`, and with `run_eagerly=True`. Given `steps_per_epoch`,
      `validation_steps` or `steps`, "auto" takes the largest number up to 16 that
      divides them (5 for `steps_per_epoch=5`), since Keras runs whole calls; an int
      is used as given, and refused where it does not divide them.
      With several batches a call, the loop over them is Keras's with its own
      control (step count, "is there a batch") computed on the host: Keras's
      computes it on the GPU and waits for it every batch (ViT-B/16 on an
      H200: 1.02x).

    Args:
        *args: `inputs, outputs` for a functional model, or nothing for a subclass.
        accumulation_steps: int >= 1, batches per weight update.
        micro_batch_size: None (whole batches) or int >= 1, rows per forward and
            backward pass.
        update_in_backward: bool. True: no step holds every gradient at once;
            each weight's update uses its gradient as soon as it is made, and
            XLA frees it then (PyTorch's "optimizer step in the backward pass").
            Checkpoint blocks apply theirs first (kvram/layers/_in_backward.py).
            With `skip_nonfinite` the backward pass runs twice: once to decide
            the skip (each gradient reduced to a flag as it is made), once to
            apply them (the same forward pass, so the same gradients), each
            assignment keeping the old value where the step is skipped: about
            1.7x a step's FLOPs. What needs every gradient first is refused
            with it: `accumulation_steps` > 1, `micro_batch_size`,
            `clip_global_norm`, a `LossScaleOptimizer` (mixed_float16) and
            several replicas. Memory measured on the CPU under XLA
            (tests/test_update_in_backward.py).
        host_offload: bool. True: `compile()` wraps the optimizer in
            `kvram.optimizers.HostOffload`, which keeps its state and a float32
            master copy of every weight in host memory and computes the update
            on the host's cores; the device holds the model's weights (bfloat16
            ones under a "bfloat16" policy) and one step's gradients, which go
            to the host in their own dtype as they are made. The step then runs
            in TensorFlow's executor; with `jit_compile`, each
            `kvram.layers.Checkpoint` block is its own XLA computation (so a
            block's gradients leave while the next block's backward pass runs),
            a model without blocks one. Accumulation (summed on the host in
            float32), clipping and the non-finite guard work as without it; not
            with `update_in_backward` or several replicas.
        clip_global_norm: None or float > 0, maximum global gradient norm.
        skip_nonfinite: bool, skip steps with NaN/Inf gradients.
        max_consecutive_skips: None (no limit) or int >= 1, skipped steps in a
            row after which `fit()` raises `FloatingPointError`.
        prefetch_to_gpu: None (off) or int >= 1: `fit()` on a `tf.data.Dataset`
            copies this many batches ahead to the GPU while the current step
            runs (`tf.data.experimental.prefetch_to_device`). Without it, each
            step starts with a blocking host-to-GPU copy of its batch: 25 ms of
            a 67 ms ResNet50 step at batch 256 on an H200, with the GPU idle
            (benchmarks/profile/). With it, a pageable batch still kept the
            GPU waiting 23.7 ms a step; a page-locked one 7.5 ms (see
            `kvram.speed.pin_host_memory()`). Costs the batches' GPU memory.
            Used on one GPU without a distribution strategy (strategies place
            data themselves); ignored otherwise.
        **kwargs: `keras.Model` arguments (`name`, ...).

    Raises:
        TypeError, ValueError: for arguments of the wrong type or value.

    Example:
    ```python
    model = kvram.Model(inputs, outputs, accumulation_steps=4, clip_global_norm=1.0)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3)
    ```
    """

    def __new__(cls, *args, **kwargs):
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            return super().__new__(_functional_class(cls))
        return super().__new__(cls)

    def __init__(
        self,
        *args,
        accumulation_steps: int = 1,
        micro_batch_size: int | None = None,
        clip_global_norm: float | None = None,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int | None = 20,
        prefetch_to_gpu: int | None = PREFETCH_TO_GPU,
        update_in_backward: bool = False,
        host_offload: bool = False,
        **kwargs,
    ):
        self.accumulation_steps = _checks.positive_int("accumulation_steps", accumulation_steps)
        self._micro_batch_size = _checks.positive_int(
            "micro_batch_size", micro_batch_size, allow_none=True
        )
        self._batch_controller = None
        self.clip_global_norm = _checks.positive_float(
            "clip_global_norm", clip_global_norm, allow_none=True
        )
        self.skip_nonfinite = _checks.boolean("skip_nonfinite", skip_nonfinite)
        self.max_consecutive_skips = _checks.positive_int(
            "max_consecutive_skips", max_consecutive_skips, allow_none=True
        )
        self.prefetch_to_gpu = _checks.positive_int(
            "prefetch_to_gpu", prefetch_to_gpu, allow_none=True
        )
        self.update_in_backward = _checks.boolean("update_in_backward", update_in_backward)
        if self.update_in_backward:
            _step.check_update_in_backward(self)
        self.host_offload = _checks.boolean("host_offload", host_offload)
        if self.host_offload and self.update_in_backward:
            raise ValueError("host_offload=True updates the weights on the host after the backward pass, so it "
                             "cannot run with update_in_backward=True. Allowed: one of them.")
        super().__init__(*args, **kwargs)
        self._built_under_policy = precision.current_policy()
        # kvram's counters, warnings given and compiled slice function: what the
        # step's functions (`_step`) and the fit loop's (`TrainFunction`) are given.
        self._step_state = _step.StepState()
        if self._micro_batch_size is not None and self.built:  # a functional model: its layers are known
            _batch_statistics.check_slices(self, self._micro_batch_size, said=self._step_state.slice_warnings)

    @property
    def skipped_steps(self) -> int:
        """Training steps skipped so far because their gradients were not finite."""
        return int(self._step_state.skipped.numpy())

    @property
    def micro_batch_size(self) -> int | None:
        """Rows per forward/backward pass; None runs each batch in one pass."""
        return self._micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int | None) -> None:
        value = _checks.positive_int("micro_batch_size", value, allow_none=True)
        if value is not None and self.update_in_backward:
            raise ValueError(f"micro_batch_size={value} cannot be set on a model with update_in_backward=True: "
                             "its slices' gradients are summed before any update.")
        if value is not None:
            _step.check_mean_reductions(getattr(self, "loss", None))
            if self.built:
                _batch_statistics.check_slices(self, value, said=self._step_state.slice_warnings)
        self._micro_batch_size = value
        function = getattr(self, "train_function", None)
        if function is not None and not isinstance(function, _train_function.TrainFunction):
            # Keras's own step does not slice batches: switch to kvram's.
            self.make_train_function(force=True)

    @property
    def inner_optimizer(self):
        """The optimizer that computes the update (inside a `LossScaleOptimizer`, a `HostOffload`, if any)."""
        return _innermost(getattr(self, "optimizer", None))

    def compile(self, optimizer="rmsprop", *args, steps_per_execution="auto", **kwargs):
        # Every check first: a compile() that is refused changes nothing (neither the
        # model, compiled before or not, nor the optimizer).
        precision.check_model_policy(self)
        _execution.check(steps_per_execution)
        optimizer = keras.optimizers.get(optimizer)
        loss = args[0] if args else kwargs.get("loss")
        if self._micro_batch_size is not None:
            _step.check_mean_reductions(loss)
        optimizer = self._offloaded(optimizer)
        inner = _innermost(optimizer)
        if inner is not None:
            self._check_optimizer(inner)
        if self.update_in_backward and (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                                        or self.dtype_policy.name == "mixed_float16"):  # Keras would wrap it
            raise ValueError(
                "update_in_backward=True cannot run with a LossScaleOptimizer (mixed_float16): it checks every "
                "gradient before it applies any. Allowed: mixed_bfloat16 or float32, which need no loss scaling.")
        auto = steps_per_execution == _execution.AUTO
        super().compile(optimizer, *args, steps_per_execution=1 if auto else steps_per_execution, **kwargs)
        self._auto_steps_per_execution = auto
        # A host update cannot sit in an XLA computation: the step runs in TensorFlow's executor,
        # each forward and backward pass compiled with XLA as `jit_compile` says (_step.slice_function).
        self._kvram_slice_jit = None
        offload = _step.offload_of(self.optimizer)
        if offload is not None:
            self._kvram_slice_jit = bool(self.jit_compile)
            self.jit_compile = False
            # counted again by this compile's step (block_inputs="host")
            offload.kept_block_inputs = offload.kept_block_input_bytes = 0
        if auto:  # saved as given, so a loaded model resolves it again
            self._compile_config.config["steps_per_execution"] = _execution.AUTO
        if inner is None:
            return
        if self.accumulation_steps > 1:
            inner.gradient_accumulation_steps = self.accumulation_steps
        if self.clip_global_norm is not None:
            inner.global_clipnorm = self.clip_global_norm

    def _offloaded(self, optimizer):
        """`optimizer`, run on the host (`HostOffload`) when the model was given host_offload=True."""
        if not self.host_offload or optimizer is None or _step.offload_of(optimizer) is not None:
            return optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "host_offload=True wraps the optimizer that computes the update, and compile() puts a "
                "LossScaleOptimizer around it under mixed_float16. Received: a LossScaleOptimizer. Allowed: its "
                "inner optimizer, or kvram.optimizers.HostOffload(inner) inside your LossScaleOptimizer.")
        return optimizers.HostOffload(optimizer)

    def _check_optimizer(self, inner) -> None:
        """Refuses an optimizer that cannot do what the model was given (accumulation,
        clipping), before `compile()` changes anything."""
        if self.accumulation_steps > 1 and self.distribute_strategy.num_replicas_in_sync > 1:
            raise ValueError(
                f"accumulation_steps={self.accumulation_steps} cannot run under "
                f"{type(self.distribute_strategy).__name__} with "
                f"{self.distribute_strategy.num_replicas_in_sync} replicas: Keras's optimizer "
                "accumulates inside a cond that would have to synchronise replicas, which "
                "tf.distribute does not allow (plain keras.Model fails the same way). Use "
                "micro_batch_size instead: a larger batch split into slices gives the same "
                "update at the memory of a slice."
            )
        if self.accumulation_steps > 1:
            current = inner.gradient_accumulation_steps
            if current not in (None, 1, self.accumulation_steps):
                raise ValueError(
                    f"The optimizer already accumulates gradients over {current} steps "
                    f"but kvram.Model was given accumulation_steps={self.accumulation_steps}. "
                    "Set one of them, not both."
                )
            if inner.built and current != self.accumulation_steps:
                raise ValueError(
                    "The optimizer is already built, so it cannot start accumulating "
                    "gradients. Pass a new optimizer (or its name) to compile(). "
                    f"Received: optimizer={inner.name!r} (built)"
                )
        if self.clip_global_norm is not None and (
            inner.clipnorm is not None or inner.clipvalue is not None
            or inner.global_clipnorm not in (None, self.clip_global_norm)
        ):
            raise ValueError(
                "The optimizer already clips gradients (clipnorm="
                f"{inner.clipnorm}, clipvalue={inner.clipvalue}, global_clipnorm="
                f"{inner.global_clipnorm}) and kvram.Model was given clip_global_norm="
                f"{self.clip_global_norm}. Set one of them, not both."
            )

    def compile_from_config(self, config):
        # Keras skips compile() on load for models that override it; kvram's
        # compile() only adds checks and settings, so the saved config is replayed.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, x=None, *args, **kwargs):
        if self.accumulation_steps > 1 and _has_unknown_cardinality(x):
            warnings.warn(
                f"accumulation_steps={self.accumulation_steps} with a dataset of unknown "
                "cardinality: Keras then runs one extra, empty step per epoch that "
                "advances `optimizer.iterations`, which shifts the accumulation windows "
                "(a known Keras pitfall). Give the dataset a known size "
                "(`dataset.apply(tf.data.experimental.assert_cardinality(n))`) or pass "
                "`steps_per_epoch`.",
                stacklevel=2,
            )
        prefetched = self._prefetched(x)
        quiet = prefetched is not x and kwargs.get("steps_per_epoch") is None and (
            int(x.cardinality()) > 0
        )
        x = prefetched
        callbacks = kwargs.get("callbacks")
        callbacks = list(callbacks or [])
        if _step.watches_skips(self):
            callbacks.append(SkipWatch(self.max_consecutive_skips, self._step_state))
        kwargs["callbacks"] = callbacks
        controllers = [c for c in callbacks if hasattr(c, "_kvram_controls_batch")]
        if len(controllers) > 1:
            raise ValueError(
                "Pass at most one AdaptiveBatchSize callback to fit(). "
                f"Received: {len(controllers)} of them"
            )
        previous = self._batch_controller
        self._batch_controller = controllers[0] if controllers else None
        if self._batch_controller is not None or previous is not None:
            self.train_function = None  # built again below, for the new controller
        _execution.resolve(self, callbacks, "train", kwargs)
        self._in_fit = True  # fit's validation runs evaluate() with fit's steps per execution
        try:
            with warnings.catch_warnings():
                if quiet:
                    # The prefetch hides the dataset's size from Keras, which then
                    # warns at the end of the first epoch that the data ran out.
                    warnings.filterwarnings("ignore", message="Your input ran out of data")
                with data.raise_shard_errors():
                    return super().fit(x, *args, **kwargs)
        finally:
            self._batch_controller = None
            self._in_fit = False

    def evaluate(self, *args, **kwargs):
        if not getattr(self, "_in_fit", False):
            _execution.resolve(self, kwargs.get("callbacks"), "test", kwargs)
        with data.raise_shard_errors():  # a failed shard check as kvram.data.ShardError
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        if not getattr(self, "_in_fit", False):  # a callback's predict() keeps fit's function
            _execution.resolve(self, kwargs.get("callbacks"), "predict", kwargs)
        with data.raise_shard_errors():
            return super().predict(*args, **kwargs)

    def _prefetched(self, x):
        """`x` prefetched to the GPU (see `prefetch_to_gpu`), or `x` unchanged."""
        if not self.prefetch_to_gpu or not isinstance(x, tf.data.Dataset):
            return x
        if tf.distribute.has_strategy() or getattr(self, "_distribute_strategy", None) is not None:
            return x
        gpus = tf.config.list_logical_devices("GPU")
        if not gpus:
            return x
        return x.apply(
            tf.data.experimental.prefetch_to_device(gpus[0].name, buffer_size=self.prefetch_to_gpu)
        )

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras's build before fit() under a strategy, from this worker's own
        replica of the first batch. Keras reduces the batch across replicas
        (`strategy.reduce("MEAN", ...)`, only for its shapes), which under
        MultiWorkerMirroredStrategy fails in eager mode: "Attempt to convert a
        value (PerReplica...)" (keras-team/keras#20585). The build needs only
        shapes and dtypes, which any replica's part has."""
        strategy = getattr(self, "_distribute_strategy", None)
        if strategy is None:
            return self._build_before_tracing(iterator, data_batch)
        if iterator is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def _build_before_tracing(self, iterator, data_batch):
        """Without a strategy Keras builds the model, its compiled loss and
        metrics and its optimizer inside the first trace of the step
        (`TensorFlowTrainer._maybe_symbolic_build`: "defer building to when the
        train/test/predict function gets traced"). A `tf.function` whose first
        trace creates variables is traced a second time before it runs
        (tensorflow/tensorflow#48851), so every fit() traced its training step
        twice. Built here as Keras builds under a strategy, from the shapes of
        the data (the dataset's element spec: no batch is read), the step is
        traced once. Data whose spec is not plain tensors (ragged, sparse,
        optional), and a model whose inference call fails on symbolic inputs,
        keep Keras's way. The small ViT of examples/mixed_precision.py (batch
        64) on 2 CPU cores: its first epoch took 12.0-15.4 s (float32, bf16,
        fp16), 19.1-20.5 s before."""
        if data_batch is None:
            dataset = getattr(iterator, "_distributed_dataset", None)
            data_batch = getattr(dataset, "element_spec", None)
            if data_batch is None or not all(
                type(spec) is tf.TensorSpec for spec in tree.flatten(data_batch)
            ):
                return None
        try:
            self._symbolic_build(data_batch=data_batch)
        except MemoryError:  # a refusal (HostOffload's host check) is the user's answer, not a reason to retry
            raise
        except Exception:  # noqa: BLE001 - built in the trace instead, as Keras does without a strategy
            pass
        return None

    def _make_function(self, step_function):
        # Keras's train and test functions, with the multi-step loop's control on the host
        if _execution.loop_on_host(self):
            return _execution.multi_step_function(self, step_function)
        return super()._make_function(step_function)

    def make_train_function(self, force=False):
        # Where Keras's own step fails (`keras_step_fails`) kvram's runs, which
        # compiles each replica's step under XLA over several local devices
        if (
            self._micro_batch_size is None
            and self._batch_controller is None
            and not _train_function.keras_step_fails(self)
        ):
            if isinstance(self.train_function, _train_function.TrainFunction):
                force = True
            return super().make_train_function(force=force)
        if self.train_function is not None and not force and isinstance(
            self.train_function, _train_function.TrainFunction
        ):
            return self.train_function
        if type(self).train_step is not Model.train_step:
            raise NotImplementedError(
                f"{type(self).__name__} overrides train_step, so kvram cannot slice its "
                "batches (micro_batch_size) or recover from out-of-memory errors "
                "(AdaptiveBatchSize). Use micro_batch_size=None and no AdaptiveBatchSize, "
                "or move the custom logic into call()/compute_loss()."
            )
        if self._micro_batch_size is not None and self.built:  # built by fit() by now
            _batch_statistics.check_slices(self, self._micro_batch_size, said=self._step_state.slice_warnings)
        self.train_function = _train_function.TrainFunction(self, self._step_state, self._batch_controller)
        return self.train_function

    def make_test_function(self, force=False):
        # Keras's test step fails where its train step does
        if not _train_function.keras_step_fails(self):
            return super().make_test_function(force=force)
        if self.test_function is None or force:
            self.test_function = _train_function.distributed_test_function(self)
        return self.test_function

    # its step computes the loss of kvram.speed.fused_cross_entropy's head itself
    _kvram_fused_head_aware = True

    def train_step(self, data):
        # Keras's TensorFlowTrainer.train_step, with the gradient handling below.
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        state = self._step_state
        if self.update_in_backward and self.trainable_weights:
            y_pred = _step.update_in_backward(self, state, x, y, sample_weight)
        elif self._micro_batch_size is None and getattr(self, "_kvram_slice_jit", None):
            gradients, y_pred = _step.offloaded_gradients(self, state, x, y, sample_weight)
        elif self._micro_batch_size is None:
            gradients, y_pred = _step.slice_gradients(self, x, y, sample_weight)
        else:
            y_pred = None
            gradients = _step.micro_batch_gradients(self, state, x, y, sample_weight, self._micro_batch_size)
        if self.update_in_backward and self.trainable_weights:
            pass  # applied, each update as soon as its gradient is there
        elif self.trainable_weights:
            offload = _step.offload_of(self.optimizer)
            if offload is not None:  # the guard and the update read host copies
                gradients = offload.to_host(gradients)
            finite = _step.all_finite(gradients)
            _step.apply_gradients(
                self,
                state,
                gradients,
                self.trainable_weights,
                finite=finite,
                bad_inputs=_step.bad_inputs(finite, (x, y, sample_weight), self),
            )
        else:
            warnings.warn("The model does not have any trainable weights.")
        if getattr(self, "_kvram_fused_head", None) is not None:  # no logits: the loss alone
            logs = {"loss": self._loss_tracker.result()}
        elif self._micro_batch_size is None:
            logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        else:
            logs = self.get_metrics_result()
        return _step.step_logs(self, state, logs)

    def get_config(self):
        config = super().get_config()
        if isinstance(self, Functional):
            config.update({name: getattr(self, name) for name in _KVRAM_ARGS})
        return config


_FUNCTIONAL_CLASSES: dict[type, type] = {}


def _functional_class(cls: type) -> type:
    """`cls` with Keras's `Functional` mixed in, for `cls(inputs, outputs)`.

    Keras itself rewrites the bases of a subclass called with `inputs, outputs`
    (`inject_functional_model_class`), which would turn `kvram.Model` into a
    functional class for every later subclass too; a derived class leaves it alone.
    It is saved under `cls`'s registered name (a `.keras` file of a user's
    `@register_keras_serializable(package="my") class Net(kvram.Model)` names
    "my>Net", which loads as `Net(inputs, outputs)` again): Keras keeps the names
    by class, and has no public call that names a class without also making it
    what the name loads.
    """
    if cls not in _FUNCTIONAL_CLASSES:
        if cls is Model:
            derived = FunctionalModel
        else:
            derived = type(cls.__name__, (cls, Functional), {"__module__": cls.__module__})
            object_registration.GLOBAL_CUSTOM_NAMES[derived] = keras.saving.get_registered_name(cls)
        _FUNCTIONAL_CLASSES[cls] = derived
    return _FUNCTIONAL_CLASSES[cls]


@keras.saving.register_keras_serializable(package="kvram")
class FunctionalModel(Model, Functional):
    """What `kvram.Model(inputs, outputs)` returns: a functional `kvram.Model`."""


def _innermost(optimizer):
    """The optimizer that computes the update, inside any `LossScaleOptimizer` and `HostOffload`."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def _has_unknown_cardinality(x) -> bool:
    if isinstance(x, tf.data.Dataset):
        return int(x.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    return False


def train_function_for(model: Model, controller=None) -> _train_function.TrainFunction:
    """A `TrainFunction` for `model` with its step state: for callers outside
    `fit()` that run its training step themselves (`find_max_batch_size`)."""
    return _train_function.TrainFunction(model, model._step_state, controller)
