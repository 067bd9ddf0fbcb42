"""PipelineModel and balance on two logical CPUs (tests/conftest.py makes them)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from kvram.parallel import PipelineModel, balance
from tests.helpers import max_rel_diff

TOL = 1e-5


@pytest.fixture(autouse=True)
def two_cpus():
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs two logical CPUs")


def layers():
    keras.utils.set_random_seed(0)
    return [
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3),
    ]


def pair(micro_batches, checkpoint=False, optimizer=lambda: keras.optimizers.Adam(0.01), defer=True):
    single = keras.Sequential([keras.Input((8,))] + layers())
    single.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    parts = layers()
    model = PipelineModel(
        [keras.Sequential(parts[:2]), keras.Sequential(parts[2:])],
        ["CPU:0", "CPU:1"],
        micro_batches=micro_batches,
        checkpoint=checkpoint,
        defer_weight_gradients=defer,
    )
    model.build((None, 8))
    for a, b in zip(single.weights, model.weights):
        b.assign(a)
    model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    return single, model


def data(n=16):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 3)).astype("float32")


@pytest.mark.parametrize(
    "micro_batches, checkpoint, defer",
    [(1, False, True), (4, False, True), (5, False, True),
     pytest.param(16, False, True, marks=pytest.mark.slow),  # 7.7 s on 2 cores
     pytest.param(5, True, True, marks=pytest.mark.slow), (5, False, False)],
)
def test_updates_equal_the_single_device_model(micro_batches, checkpoint, defer):
    x, y = data()
    single, model = pair(micro_batches, checkpoint, defer=defer)
    h1 = single.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    h2 = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    assert max_rel_diff([v.numpy() for v in single.weights], [v.numpy() for v in model.weights]) < TOL
    for a, b in zip(single.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=TOL, atol=1e-7)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=TOL)
    np.testing.assert_allclose(h1.history["mae"], h2.history["mae"], rtol=TOL)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "per_slice"])
def test_variables_slots_and_ops_are_on_their_stage_device(defer):
    x, y = data()
    _, model = pair(4, defer=defer)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    devices = {0: "CPU:0", 1: "CPU:1"}
    for k, stage in enumerate(model.stages):
        for variable in stage.weights:
            assert variable.value.device.endswith(devices[k]), variable.path
    optimizer = model.optimizer
    slots = list(zip(optimizer._trainable_variables, optimizer._momentums, optimizer._velocities))
    assert len(slots) == 6
    for variable, momentum, velocity in slots:
        device = variable.value.device
        assert momentum.value.device == device and velocity.value.device == device

    # Forward and backward ops of each stage, and its updates, ask for its device.
    graph = tf.function(model.train_step).get_concrete_function((x, y)).graph
    seen = {0: 0, 1: 0}
    for op in graph.get_operations():
        if op.type in ("Placeholder", "ReadVariableOp"):
            continue  # variable handles and reads run where the variable lives (checked above)
        for k in (0, 1):
            if f"stage{k}_forward" in op.name or f"stage{k}_backward" in op.name:
                assert op.device.endswith(devices[k]), (op.name, op.device)
                seen[k] += 1
    assert seen[0] > 20 and seen[1] > 20
    # Backward: tape.gradient names its ops "gradient_tape/<forward op>"; stage 1's
    # run on CPU:1, not on the default device.
    for k in (0, 1):
        matmuls = [op for op in graph.get_operations()
                   if op.name.startswith(f"gradient_tape/stage{k}_forward") and op.type == "MatMul"]
        weight = [op for op in graph.get_operations()
                  if op.name.startswith(f"stage{k}_weight_gradients/") and op.type == "MatMul"]
        dense = len(model.stages[k].layers)
        if defer:
            # Each Dense kernel's gradient is one product over the batch's 16 rows
            # (not one per 4-row slice), on the stage's device; the slices'
            # backward computes input gradients only
            assert not matmuls and len(weight) == dense, [op.name for op in weight]
            assert all(op.inputs[0].shape[0] == 16 and op.device.endswith(devices[k]) for op in weight)
        else:
            assert len(matmuls) >= 4 * dense and all(op.device.endswith(devices[k]) for op in matmuls)
            assert not weight

    # The optimizer's update math and the finiteness checks run where the
    # variable lives (inside the skip-step cond, whose branches are functions):
    # on GPUs, anything left unplaced lands on GPU:0 and drags every stage's
    # gradients and slots there.
    shapes = {k: {tuple(v.shape) for v in stage.trainable_weights} for k, stage in enumerate(model.stages)}
    assert not shapes[0] & shapes[1]
    update_types = {"IsFinite", "Sub", "Mul", "Square", "Sqrt", "RealDiv", "AssignAddVariableOp",
                    "AssignSubVariableOp"}
    checked = {0: 0, 1: 0}
    for op in _all_operations(graph):
        if op.type not in update_types or not op.inputs:
            continue
        if op.type != "IsFinite" and "adam" not in op.name:
            continue  # (the L2 regulariser of stage 0 is computed with the loss, on CPU:1)
        for k in (0, 1):
            if any(tuple(t.shape) in shapes[k] for t in op.inputs):
                assert op.device.endswith(devices[k]), (op.name, op.type, op.device)
                checked[k] += 1
    assert checked[0] >= 20 and checked[1] >= 10, checked


def _all_operations(graph, seen=None):
    """Operations of a function graph and of the functions it calls (cond branches)."""
    seen = set() if seen is None else seen
    yield from graph.get_operations()
    for function in graph._functions.values():
        if function.name not in seen:
            seen.add(function.name)
            yield from _all_operations(function.graph, seen)


@pytest.mark.slow
def test_mixed_float16_with_loss_scaling_equals_the_single_device_model():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data()
    single, model = pair(4)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    single.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    # fp16 forward passes, float32 weights and updates: slices round differently.
    assert max_rel_diff([v.numpy() for v in single.weights], [v.numpy() for v in model.weights]) < 1e-3
    inner = model.optimizer.inner_optimizer
    for variable, momentum in zip(inner._trainable_variables, inner._momentums):
        assert momentum.value.device == variable.value.device
    assert float(model.optimizer.dynamic_scale) == float(single.optimizer.dynamic_scale)


@pytest.mark.slow
def test_save_and_load_keeps_stages_devices_and_weights(tmp_path):
    x, y = data()
    _, model = pair(4, checkpoint=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "pipeline.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, PipelineModel)
    assert loaded.device_names == model.device_names and loaded.micro_batches == 4
    for k, stage in enumerate(loaded.stages):
        for variable in stage.weights:
            assert variable.value.device == model.stages[k].weights[0].value.device
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)  # and it trains on


def test_short_batch_and_bad_arguments():
    stages = [keras.layers.Dense(4), keras.layers.Dense(2)]
    with pytest.raises(ValueError, match="2 stages but only 1 devices"):
        PipelineModel(stages, ["CPU:0"])
    with pytest.raises(ValueError, match="3 devices for 2 stages"):
        PipelineModel(stages, ["CPU:0", "CPU:1", "CPU:0"])
    with pytest.raises(ValueError, match=r"^Unknown device 'GPU:7'\. Logical devices here: \[.*\]\. \(Split one "
                       r"physical device into several with tf\.config\.set_logical_device_configuration\.\)$"):
        PipelineModel(stages, ["CPU:0", "GPU:7"])
    with pytest.raises(ValueError, match="micro_batches=0"):
        PipelineModel(stages, ["CPU:0", "CPU:1"], micro_batches=0)
    with pytest.raises(TypeError, match="Keras layer"):
        PipelineModel([stages[0], "dense"], ["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match="micro_batch_size and accumulation_steps"):
        PipelineModel(stages, ["CPU:0", "CPU:1"], micro_batch_size=2)
    model = PipelineModel(stages, ["CPU:0", "CPU:1"], micro_batches=8)
    with pytest.raises(ValueError, match="XLA ignores"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"^PipelineModel\(micro_batches=8\) cuts every batch into 8 slices of at "
                                         r"least one row, and was given 4 rows at batch_size=4, whose batch of 4 "
                                         r"rows is fewer than 8 \(a short last batch\?\); nothing was trained\. "
                                         r"Drop it"):
        model.fit(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), batch_size=4, verbose=0)
    with pytest.raises(ValueError, match=r"was given 10 rows at batch_size=8, whose batch of 2 rows is fewer"):
        model.fit(np.ones((10, 3), "float32"), np.ones((10, 2), "float32"), batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def _pipeline_with_batch_norm():
    keras.utils.set_random_seed(0)
    model = PipelineModel([keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization()]),
                           keras.layers.Dense(3)], ["CPU:0", "CPU:1"], micro_batches=4)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def test_a_short_last_batch_of_a_dataset_is_refused_with_nothing_of_it_applied():
    x, y = data(10)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)  # 4, 4, then 2 rows
    short = _pipeline_with_batch_norm()
    with pytest.raises(ValueError, match=r"^PipelineModel\(micro_batches=4\) cuts every batch into 4 slices of at "
                                         r"least one row, and was given a batch of fewer rows \(a short last "
                                         r"batch\?\); nothing of that batch was applied\. Drop it \(tf\.data: "
                                         r"batch\(\.\.\., drop_remainder=True\)\)"):
        short.fit(dataset, verbose=0)
    whole = _pipeline_with_batch_norm()
    whole.fit(dataset.take(2), verbose=0)
    assert int(short.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy()) == 2
    for a, b in zip(short.variables, whole.variables):  # weights, moving statistics, optimizer state
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(short.optimizer.variables, whole.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_balance_by_memory_and_time():
    keras.utils.set_random_seed(0)
    stack = [keras.layers.Dense(n, activation="relu") for n in (512, 512, 16, 16, 16, 16)]
    sample = np.ones((32, 64), "float32")
    result = balance(stack, ["CPU:0", "CPU:1"], by="memory", sample_batch=sample)
    # Layer 1 (512x512 weights) alone outweighs everything after it.
    assert result.groups == [[0], [1, 2, 3, 4, 5]] or result.groups == [[0, 1], [2, 3, 4, 5]]
    totals = [sum(result.costs[i] for i in g) for g in result.groups]
    assert max(totals) == min(
        max(sum(result.costs[:j]), sum(result.costs[j:])) for j in range(1, len(stack))
    )
    assert "largest stage" in result.report and "CPU:1" in result.report
    model = PipelineModel(result.stages, result.devices, micro_batches=4)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(sample, np.ones((32, 16), "float32"), batch_size=32, verbose=0)
    timed = balance(stack, ["CPU:0", "CPU:1"], by="time", sample_batch=sample)
    assert sorted(i for g in timed.groups for i in g) == list(range(6)) and all(timed.costs)
    with pytest.raises(ValueError, match="by='size'"):
        balance(stack, ["CPU:0"], by="size", sample_batch=sample)
    with pytest.raises(ValueError, match="between 1 and 6 devices"):
        balance(stack, ["CPU:0"] * 7, sample_batch=sample)


def test_stages_built_elsewhere_are_moved_with_their_weights():
    """torchgpipe's convenience: stages built (here trained) on the default device
    are moved to their own; the same Keras variables, the same values, and
    training then equals the single-device model's."""
    x, y = data()
    single = keras.Sequential([keras.Input((8,))] + layers())
    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    single.fit(x, y, batch_size=16, epochs=1, verbose=0)  # trained: built on CPU:0, not at its start
    parts = layers()
    stages = [keras.Sequential(parts[:2]), keras.Sequential(parts[2:])]
    stages[1](stages[0](x))  # built on the default device, CPU:0
    for a, b in zip(single.weights, stages[0].weights + stages[1].weights):
        b.assign(a)
    kept = [(v, v.numpy()) for v in stages[1].weights]
    assert all(v.value.device.endswith("CPU:0") for v, _ in kept)
    model = PipelineModel(stages, ["CPU:0", "CPU:1"], micro_batches=4)
    model.build((None, 8))
    for variable, value in kept:
        assert variable.value.device.endswith("CPU:1"), variable.path
        np.testing.assert_array_equal(variable.numpy(), value)
    assert [id(v) for v in model.stages[1].weights] == [id(v) for v, _ in kept]
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")  # a fresh optimizer, as model's
    single.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    assert max_rel_diff([v.numpy() for v in single.weights], [v.numpy() for v in model.weights]) < TOL
    assert all(v.value.device.endswith("CPU:1") for v in model.stages[1].weights)


def test_stages_of_a_strategy_cannot_be_moved(mirrored):
    with mirrored.scope():
        stage = keras.layers.Dense(4)
        stage.build((None, 3))  # mirrored variables on both CPUs
    model = PipelineModel([keras.layers.Dense(3), stage], ["CPU:0", "CPU:1"], micro_batches=2)
    with pytest.raises(ValueError, match=r"Stage 1 .* was built before PipelineModel placed it, and its "
                                         r"variable .* cannot be moved to .*CPU:1"):
        model.build((None, 5))


def _memory_optimization():
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    config.ParseFromString(context.context().function_call_options.config_proto_serialized or b"")
    return config.graph_options.rewrite_options.memory_optimization


@pytest.mark.parametrize("host_swapping", [False, True])
def test_training_step_runs_without_host_swapping_by_default(host_swapping):
    """The step's function is called and traced with Grappler's memory optimizer
    off (the `config_proto` each eager function call carries), unless
    host_swapping=True; the option is restored after the call and saved."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            graph, names = tf.compat.v1.get_default_graph(), []
            while graph is not None:
                names.append(getattr(graph, "name", ""))
                graph = getattr(graph, "outer_graph", None)
            if any("step" in n for n in names):  # while the step is traced (not while built)
                seen.append(_memory_optimization())
            return x

    x, y = data()
    parts = layers()
    model = PipelineModel(
        [keras.Sequential(parts[:2]), keras.Sequential([Probe()] + parts[2:])],
        ["CPU:0", "CPU:1"], micro_batches=2, host_swapping=host_swapping,
    )
    model.compile(optimizer="sgd", loss="mse")
    before = _memory_optimization()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    off = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    assert seen and all((v == off) != host_swapping for v in seen), seen
    assert _memory_optimization() == before
    assert model.get_config()["host_swapping"] is host_swapping
