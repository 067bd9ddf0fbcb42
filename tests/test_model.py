import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.layers import Checkpoint
from tests.helpers import max_rel_diff, values

TOL = 1e-5


def mlp(cls=kvram.Model, checkpoint=True, **kwargs):
    inputs = keras.Input((8,))
    block = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8)])
    x = (Checkpoint(block) if checkpoint else block)(inputs)
    outputs = keras.layers.Dense(3, dtype="float32")(x)
    return cls(inputs, outputs, **kwargs)


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 3)).astype("float32")


def copy_weights(src, dst):
    for a, b in zip(src.weights, dst.weights):
        b.assign(a)


def dyadic_model(**kwargs):
    """A linear model on small dyadic numbers: float16 computes it exactly, so any
    difference under mixed_float16 is the training step's, not rounding's."""
    rng = np.random.default_rng(7)

    def init(shape, dtype=None):
        return rng.integers(-4, 5, size=shape).astype("float32") / 4

    inputs = keras.Input((8,))
    x = Checkpoint(keras.layers.Dense(4, kernel_initializer=init, bias_initializer="zeros"))(inputs)
    outputs = keras.layers.Dense(4, kernel_initializer=init, dtype="float32")(x)
    return kvram.Model(inputs, outputs, **kwargs)


# float16 rounds random data differently at different batch sizes, so under
# mixed_float16 the model computes on dyadic numbers, which float16 holds exactly.
@pytest.mark.parametrize(
    "policy, builder",
    [("float32", "random"), ("float32", "dyadic"), ("mixed_float16", "dyadic")],
)
def test_accumulation_equals_one_large_batch(policy, builder):
    n, b = 4, 8
    kvram.precision.enable(policy)
    make = mlp if builder == "random" else dyadic_model
    big = make(accumulation_steps=1)
    acc = make(accumulation_steps=n)
    copy_weights(big, acc)

    def optimizer():
        sgd = keras.optimizers.SGD(2.0**-6)
        if policy == "mixed_float16":  # small scale: exact, and no overflow to skip
            return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0**3)
        return sgd

    for m in (big, acc):
        m.compile(optimizer=optimizer(), loss="mse")
    if builder == "random":
        x, y = data(n * b)
    else:
        rng = np.random.default_rng(3)
        x = rng.integers(-1, 2, size=(n * b, 8)).astype("float32")
        y = rng.integers(-2, 3, size=(n * b, 4)).astype("float32")
    big.fit(x, y, batch_size=n * b, epochs=1, shuffle=False, verbose=0)
    acc.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    assert acc.skipped_steps == 0
    if policy == "mixed_float16":
        assert acc.layers[1].compute_dtype == "float16"
        assert acc.optimizer.inner_optimizer.gradient_accumulation_steps == n
    # `iterations` counts weight updates; the optimizer's private counter, batches.
    assert int(acc.inner_optimizer.iterations.numpy()) == 1
    assert int(acc.inner_optimizer._iterations.numpy()) == n
    assert max_rel_diff(values(big.trainable_weights), values(acc.trainable_weights)) <= TOL
    # And the update really happened (the weights moved from their start).
    fresh = make(accumulation_steps=1)
    assert max_rel_diff(values(fresh.trainable_weights), values(acc.trainable_weights)) > 1e-4


def test_compile_wraps_loss_scale_optimizer_under_mixed_float16():
    kvram.precision.enable("mixed_float16")
    model = mlp(accumulation_steps=2, clip_global_norm=1.0)
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.inner_optimizer.gradient_accumulation_steps == 2
    assert model.inner_optimizer.global_clipnorm == 1.0
    assert kvram.precision.loss_scale(model) == 2.0**15


def test_accumulation_updates_only_every_n_batches():
    model = mlp(accumulation_steps=3)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(16)
    before = values(model.trainable_weights)
    model.train_on_batch(x[:8], y[:8])
    model.train_on_batch(x[8:], y[8:])
    assert max_rel_diff(before, values(model.trainable_weights)) == 0.0
    model.train_on_batch(x[:8], y[:8])
    assert max_rel_diff(before, values(model.trainable_weights)) > 0.0


def _all_optimizer_values(model):
    return values(model.optimizer.variables)


@pytest.mark.parametrize("bad, jit_compile", [  # jit_compile: the guard is an XLA conditional
    (np.nan, False), (np.nan, True), (np.inf, False), pytest.param(np.inf, True, marks=pytest.mark.slow)])
def test_nonfinite_batch_changes_nothing_and_is_counted(bad, jit_compile):
    model = mlp()
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss="mse", jit_compile=jit_compile)
    x, y = data(16)
    model.train_on_batch(x, y)  # optimizer built, slots non-zero
    weights, slots = values(model.weights), _all_optimizer_values(model)
    x_bad = x.copy()
    x_bad[3, 2] = bad
    logs = model.train_on_batch(x_bad, y, return_dict=True)
    assert logs["skipped_steps"] == 1
    assert model.skipped_steps == 1
    for a, b in zip(weights, values(model.weights)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(slots, _all_optimizer_values(model)):
        np.testing.assert_array_equal(a, b)
    model.train_on_batch(x, y)
    assert model.skipped_steps == 1
    assert max_rel_diff(weights, values(model.weights)) > 0.0


def test_nonfinite_batch_under_loss_scaling():
    kvram.precision.enable("mixed_float16")
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = data(16)
    model.train_on_batch(x, y)
    scale = kvram.precision.loss_scale(model)
    weights = values(model.weights)
    inner = values(model.optimizer.inner_optimizer.variables)
    x[0, 0] = np.nan
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["skipped_steps"] == 1 and model.skipped_steps == 1
    for a, b in zip(weights, values(model.weights)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(inner, values(model.optimizer.inner_optimizer.variables)):
        np.testing.assert_array_equal(a, b)
    # Dynamic loss scaling halves its scale on a non-finite step: by design.
    assert kvram.precision.loss_scale(model) == scale / 2
    assert logs["loss_scale"] == scale / 2


def test_skip_nonfinite_false_lets_nan_through():
    model = mlp(skip_nonfinite=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(16)
    x[0, 0] = np.nan
    model.train_on_batch(x, y)
    assert model.skipped_steps == 1  # still counted
    assert not np.isfinite(values(model.trainable_weights)[0]).all()


def _train_step_hlo(model, x, y):
    model.train_on_batch(x, y)  # built, optimizer too
    step = tf.function(model.train_step, jit_compile=True)
    return step.experimental_get_compiler_ir((tf.constant(x), tf.constant(y)))(stage="hlo")


@pytest.mark.slow  # XLA compiles
def test_a_step_nothing_watches_for_skips_has_no_xla_conditional():
    # An XLA conditional's predicate is copied to the host and waited for on
    # a GPU, once a step; the batch's NaN check only feeds the skip diagnosis.
    x, y = data(16)
    guarded = mlp()
    guarded.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert "conditional(" in _train_step_hlo(guarded, x, y)
    unwatched = mlp(skip_nonfinite=False, max_consecutive_skips=None)
    unwatched.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert "conditional(" not in _train_step_hlo(unwatched, x, y)
    x[0, 0] = np.nan
    logs = unwatched.train_on_batch(x, y, return_dict=True)
    assert logs["skipped_steps"] == 1  # still counted


def test_clip_global_norm_bounds_the_update():
    model = mlp(clip_global_norm=1e-3)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    assert model.inner_optimizer.global_clipnorm == 1e-3
    x, y = data(16)
    before = values(model.trainable_weights)
    model.train_on_batch(x, 1e3 * y)
    after = values(model.trainable_weights)
    norm = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(before, after)))
    assert norm == pytest.approx(1e-3, rel=1e-4)


def test_clip_conflict_with_optimizer_clipping():
    model = mlp(clip_global_norm=1.0)
    with pytest.raises(ValueError, match=r"already clips gradients \(clipnorm=0.5"):
        model.compile(optimizer=keras.optimizers.SGD(clipnorm=0.5), loss="mse")


def test_a_refused_compile_changes_nothing():
    x, y = data(16)
    keras.utils.set_random_seed(2)
    plain = mlp(keras.Model, checkpoint=False)
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, batch_size=4, epochs=2, verbose=0)

    keras.utils.set_random_seed(2)
    net = mlp(checkpoint=False, micro_batch_size=2)
    summed = keras.losses.MeanSquaredError(reduction="sum")
    with pytest.raises(ValueError, match=r"micro_batch_size needs losses that average over the batch .*"
                                         r"Received: loss 'mean_squared_error' with reduction='sum'"):
        net.compile(optimizer="sgd", loss=summed)
    assert not net.compiled
    with pytest.raises(ValueError, match="You must call `compile\(\)` before"):
        net.fit(x, y, batch_size=4, verbose=0)
    net.compile(optimizer="sgd", loss="mse")
    net.fit(x, y, batch_size=4, verbose=0)
    # compiled and trained: a second refused compile keeps the first one's optimizer and loss
    optimizer = net.optimizer
    with pytest.raises(ValueError, match="reduction='sum'"):
        net.compile(optimizer="adam", loss=summed)
    assert net.optimizer is optimizer and net.loss == "mse"
    net.fit(x, y, batch_size=4, verbose=0)
    assert int(net.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 8
    for a, b in zip(values(net.weights), values(plain.weights)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_refused_compile_leaves_the_optimizer_as_it_was():
    model = mlp(accumulation_steps=2, clip_global_norm=1.0)
    optimizer = keras.optimizers.SGD(clipnorm=0.5)
    with pytest.raises(ValueError, match=r"already clips gradients \(clipnorm=0.5"):
        model.compile(optimizer=optimizer, loss="mse")
    assert optimizer.gradient_accumulation_steps is None and optimizer.global_clipnorm is None
    assert not model.compiled


def test_metrics_evaluate_predict_as_keras():
    plain = mlp(cls=keras.Model, checkpoint=False)
    ours = mlp(checkpoint=True)
    copy_weights(plain, ours)
    for m in (plain, ours):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    x, y = data(64)
    h1 = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    h2 = ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert set(h2) == set(h1) | {"skipped_steps"}
    for key in h1:
        np.testing.assert_allclose(h2[key], h1[key], rtol=TOL)
    e1, e2 = plain.evaluate(x, y, verbose=0), ours.evaluate(x, y, verbose=0)
    assert len(e1) == len(e2) == 2
    np.testing.assert_allclose(e2, e1, rtol=TOL)
    assert max_rel_diff([plain.predict(x, verbose=0)], [ours.predict(x, verbose=0)]) <= TOL


@keras.saving.register_keras_serializable(package="kvram_tests")
class Net(kvram.Model):
    def __init__(self, width=8, **kwargs):
        super().__init__(accumulation_steps=2, **kwargs)
        self.width = width
        self.block = Checkpoint(
            keras.Sequential([keras.layers.Dense(width, activation="relu"), keras.layers.Dropout(0.2)])
        )
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.head(self.block(x, training=training))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def test_subclassed_model_trains():
    model = Net()
    model.compile(optimizer="adam", loss="mse")
    x, y = data(32)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.inner_optimizer.gradient_accumulation_steps == 2


def test_functional_use_leaves_kvram_model_alone():
    mlp()
    assert kvram.Model.__bases__ == (keras.Model,)
    assert type(mlp()).__name__ == "FunctionalModel"
    assert isinstance(mlp(), kvram.Model)


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_keras_save_load_round_trip(tmp_path, kind):
    model = mlp(accumulation_steps=2, clip_global_norm=0.5) if kind == "functional" else Net()
    model.compile(optimizer="adam", loss="mse")
    x, y = data(32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kvram.Model)
    assert loaded.accumulation_steps == 2
    if kind == "functional":
        assert loaded.clip_global_norm == 0.5
        assert any(isinstance(l, Checkpoint) for l in loaded.layers)
    else:
        assert isinstance(loaded.block, Checkpoint)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # trains on after loading


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"accumulation_steps": 0}, ValueError, r"`accumulation_steps` must be an int >= 1. Received: accumulation_steps=0"),
        ({"accumulation_steps": 2.5}, TypeError, r"Received: accumulation_steps=2.5 of type float"),
        ({"clip_global_norm": -1.0}, ValueError, r"`clip_global_norm` must be a finite float > 0 or None. Received: clip_global_norm=-1.0"),
        ({"clip_global_norm": "1"}, TypeError, r"Received: clip_global_norm='1' of type str"),
        ({"skip_nonfinite": 1}, TypeError, r"`skip_nonfinite` must be True or False. Received: skip_nonfinite=1"),
    ],
)
def test_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        mlp(**kwargs)


def test_unknown_cardinality_warns_with_accumulation():
    model = mlp(accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(16)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(4)
    with pytest.warns(UserWarning, match="unknown cardinality"):
        model.fit(ds, epochs=1, verbose=0, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(
            ds.apply(tf.data.experimental.assert_cardinality(4)), epochs=1, verbose=0, shuffle=False
        )


def test_built_optimizer_cannot_start_accumulating():
    model = mlp(accumulation_steps=2)
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="already built"):
        model.compile(optimizer=optimizer, loss="mse")


# steps_per_execution="auto", kvram.Model's default (kvram/training/_execution.py)


class _EveryBatch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(batch)


def _fitted(steps_per_execution="auto", callbacks=(), **compile_kwargs):
    net = mlp(checkpoint=False)
    net.compile(optimizer="adam", loss="mse", steps_per_execution=steps_per_execution, **compile_kwargs)
    x, y = data(n=40 * 8)
    net.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0,
            callbacks=list(callbacks))
    return net


def test_auto_runs_sixteen_batches_a_call_and_trains_the_same():
    fast = _fitted()
    assert fast.steps_per_execution == 16
    keras.utils.set_random_seed(1234)
    one = _fitted(steps_per_execution=1)
    assert one.steps_per_execution == 1
    assert int(fast.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 80
    for a, b in zip(values(fast.weights), values(one.weights)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_auto_runs_one_batch_a_call_for_a_callback_that_sees_every_batch():
    watcher = _EveryBatch()
    net = _fitted(callbacks=[watcher])
    assert net.steps_per_execution == 1 and watcher.seen == list(range(40)) * 2
    seen = []
    net = _fitted(callbacks=[keras.callbacks.LambdaCallback(on_batch_end=lambda b, logs: seen.append(b))])
    assert net.steps_per_execution == 1 and len(seen) == 80
    # Epoch-level callbacks need no batch: 16 a call.
    assert _fitted(callbacks=[keras.callbacks.EarlyStopping("loss", patience=5)]).steps_per_execution == 16
    assert _fitted(run_eagerly=True).steps_per_execution == 1


def test_a_number_is_kept_and_a_bad_value_is_refused():
    assert _fitted(steps_per_execution=4, callbacks=[_EveryBatch()]).steps_per_execution == 4
    net = mlp(checkpoint=False)
    for bad in (0, "fast", 2.0, True):
        with pytest.raises(ValueError, match=r"steps_per_execution must be 'auto' or an int >= 1. Received: "):
            net.compile(optimizer="adam", loss="mse", steps_per_execution=bad)


def _updates(build, fit_kwargs, compile_kwargs=None, accumulation_steps=1):
    """optimizer.iterations after fit() of the model `build` makes (accumulation
    on the optimizer for plain Keras, on kvram.Model for kvram's)."""
    keras.utils.set_random_seed(5)
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=accumulation_steps if build is keras.Model
                                     and accumulation_steps > 1 else None)
    kwargs = {"accumulation_steps": accumulation_steps} if build is not keras.Model else {}
    net = mlp(build, checkpoint=False, **kwargs)
    net.compile(optimizer=optimizer, loss="mse", **(compile_kwargs or {}))
    net.fit(**fit_kwargs, verbose=0)
    return int(net.optimizer.iterations.numpy()), net


def test_steps_per_epoch_below_sixteen_runs_as_many_batches_as_plain_keras():
    x, y = data(n=64)
    arrays = {"x": x, "y": y, "batch_size": 4, "epochs": 2, "steps_per_epoch": 5}
    assert _updates(keras.Model, arrays)[0] == _updates(kvram.Model, arrays)[0] == 10
    repeated = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat(), "epochs": 3,
                "steps_per_epoch": 4}
    plain, _ = _updates(keras.Model, repeated, accumulation_steps=2)
    ours, net = _updates(kvram.Model, repeated, accumulation_steps=2)
    assert plain == ours == 6 and net.steps_per_execution == 4
    # 40 batches an epoch: the largest divisor up to 16 is 10
    assert _updates(kvram.Model, {**repeated, "steps_per_epoch": 40, "epochs": 1})[1].steps_per_execution == 10


class _Rows(keras.metrics.Metric):
    """The rows a loop has seen."""

    def __init__(self, name="rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.cast(tf.shape(y_true)[0], self.total.dtype))

    def result(self):
        return self.total


def test_evaluate_steps_and_validation_steps_run_as_many_batches_as_asked():
    x, y = data(n=64)
    net = mlp(checkpoint=False)
    net.compile(optimizer="sgd", loss="mse", metrics=[_Rows()])
    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    assert net.evaluate(repeated, steps=3, verbose=0, return_dict=True)["rows"] == 12
    assert net.steps_per_execution == 3
    history = net.fit(repeated, steps_per_epoch=4, validation_data=repeated, validation_steps=6, epochs=1,
                      verbose=0).history
    assert net.steps_per_execution == 2 and int(net.optimizer.iterations.numpy()) == 4
    assert history["rows"] == [16] and history["val_rows"] == [24]
    assert net.predict(repeated.map(lambda a, b: a), steps=3, verbose=0).shape == (12, 3)


def test_a_steps_per_execution_that_does_not_divide_steps_per_epoch_is_refused():
    x, y = data(n=64)
    net = mlp(checkpoint=False)
    net.compile(optimizer="sgd", loss="mse", steps_per_execution=16)
    with pytest.raises(ValueError, match=r"steps_per_execution=16 does not divide steps_per_epoch=5: Keras runs "
                                         r"16 batches a call, so it would run 16 batches where 5 were asked for"):
        net.fit(x, y, batch_size=4, steps_per_epoch=5, verbose=0)
    assert int(net.optimizer.iterations.numpy()) == 0
    with pytest.raises(ValueError, match=r"does not divide steps=3"):
        net.evaluate(x, y, batch_size=4, steps=3, verbose=0)


def test_auto_is_saved_as_auto(tmp_path):
    net = _fitted()
    path = tmp_path / "auto.keras"
    net.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_compile_config()["steps_per_execution"] == "auto"
    assert loaded._auto_steps_per_execution and loaded.steps_per_execution == 1  # until fit resolves it


def _keras_loop(net):
    """`net` with Keras's own multi-step loop instead of kvram's."""
    net._make_function = lambda step_function: keras.Model._make_function(net, step_function)
    return net


@pytest.mark.parametrize("known_size, jit_compile", [
    (True, False), (True, True), (False, False), pytest.param(False, True, marks=pytest.mark.slow)])
def test_the_multi_step_loop_on_the_host_trains_as_keras_loop_does(jit_compile, known_size):
    # 10 batches at 4 a call: the last call is short; two epochs; and evaluate
    x, y = data(n=10 * 8)
    runs = []
    for keras_loop in (False, True):
        keras.utils.set_random_seed(3)
        net = mlp(checkpoint=False)
        if keras_loop:
            _keras_loop(net)
        net.compile(optimizer="adam", loss="mse", steps_per_execution=4, jit_compile=jit_compile)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        if not known_size:
            dataset = dataset.filter(lambda a, b: True)  # cardinality unknown: the loop finds the end
        history = net.fit(dataset, epochs=2, verbose=0).history
        runs.append((values(net.weights), history, net.evaluate(dataset, verbose=0),
                     int(net.optimizer.iterations.numpy())))
    (weights, history, evaluated, iterations), keras_run = runs
    assert iterations == keras_run[3] == 20
    assert history == keras_run[1] and evaluated == keras_run[2]
    for a, b in zip(weights, keras_run[0]):
        np.testing.assert_array_equal(a, b)


def _nodes(function_graph_def):
    nodes = list(function_graph_def.node)
    for function in function_graph_def.library.function:
        nodes += list(function.node_def)
    return nodes


def test_the_multi_step_loop_control_is_placed_on_the_host():
    # On a GPU, Keras's loop computed its condition there and waited for it
    # once a step (kvram/training/_execution.py, multi_step_function)
    x, y = data(n=4 * 8)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    for keras_loop in (False, True):
        net = mlp(checkpoint=False)
        if keras_loop:
            _keras_loop(net)
        net.compile(optimizer="adam", loss="mse", steps_per_execution=4)
        net.fit(dataset, verbose=0)
        multi_step = getattr(net.train_function, "multi_step", None)
        if keras_loop:
            assert multi_step is None
            continue
        graph = multi_step.get_concrete_function(iter(dataset)).graph.as_graph_def()
        control = [n for n in _nodes(graph) if n.op in ("LogicalAnd", "Less", "GreaterEqual")]
        assert {n.op for n in control} >= {"LogicalAnd", "Less", "GreaterEqual"}
        assert all("CPU:0" in n.device for n in control), [(n.op, n.device) for n in control]


class _Traces:
    """Counts the traces of a model's train_step and test_step."""

    def __init__(self, model):
        self.train = self.test = 0
        train_step, test_step = model.train_step, model.test_step

        def counted_train(data):
            self.train += 1
            return train_step(data)

        def counted_test(data):
            self.test += 1
            return test_step(data)

        model.train_step, model.test_step = counted_train, counted_test


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("feed", ["arrays", "dataset"])
@pytest.mark.parametrize("builder", ["functional", "subclassed"])
def test_fit_and_evaluate_trace_their_step_once(policy, feed, builder):
    # Keras builds the optimizer's slots and the metrics' variables inside the
    # first trace without a strategy, and TensorFlow then traces the step again
    # (tensorflow/tensorflow#48851); kvram builds them before (Model._build_before_tracing).
    kvram.precision.enable(policy)
    net = mlp(checkpoint=True) if builder == "functional" else Net()
    traces = _Traces(net)
    net.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data(64)
    fed = (x, y) if feed == "arrays" else (tf.data.Dataset.from_tensor_slices((x, y)).batch(16),)
    net.evaluate(*fed, verbose=0)
    history = net.fit(*fed, **({"batch_size": 16} if feed == "arrays" else {}), epochs=2, verbose=0)
    net.evaluate(*fed, verbose=0)
    assert (traces.train, traces.test) == (1, 1)
    assert np.isfinite(history.history["loss"]).all()


def test_data_that_is_not_plain_tensors_still_trains():
    # A ragged input's spec is no plain TensorSpec: the model is built in the trace, as Keras does.
    rows = tf.ragged.constant([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]])
    x = tf.data.Dataset.from_tensor_slices((rows, tf.constant([[1.0], [0.0], [1.0], [0.0]]))).batch(2)

    class Sum(kvram.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, ragged):
            return self.dense(tf.expand_dims(tf.reduce_sum(ragged, axis=1), -1))

    net = Sum()
    net.compile(optimizer="sgd", loss="mse")
    history = net.fit(x, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and int(net.optimizer.iterations.numpy()) == 4


def test_a_model_that_cannot_be_built_from_shapes_alone_still_trains():
    # Keras builds from shapes by an inference call (training=False) on symbolic
    # inputs; where that call fails, the model is built in the trace, as Keras does.
    class Picky(kvram.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x, training=False):
            if not training and x.shape[0] is None:
                raise TypeError("this model predicts on batches of a known size only")
            return self.dense(x)

    net = Picky()
    net.compile(optimizer="sgd", loss="mse")
    x, y = data(32)
    history = net.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and int(net.optimizer.iterations.numpy()) == 8
