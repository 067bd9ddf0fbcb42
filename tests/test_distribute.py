"""kvram.Model under tf.distribute.MirroredStrategy over two logical CPUs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from tests.helpers import in_own_process, max_rel_diff

TOL = 1e-5


def make(**kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = kvram.layers.Checkpoint(
        keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dropout(0.2)])
    )(inputs)
    outputs = keras.layers.Dense(3)(x)
    model = kvram.Model(inputs, outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 3)).astype("float32")


@pytest.mark.parametrize(
    "kwargs",
    [  # each over 5 s on 2 cores but the clipped one (4.9 s): slow
        pytest.param({}, id="plain", marks=pytest.mark.slow),
        pytest.param({"micro_batch_size": 3}, id="micro_batches", marks=pytest.mark.slow),
        pytest.param({"micro_batch_size": 5}, id="uneven_micro_batches", marks=pytest.mark.slow),
        pytest.param({"clip_global_norm": 0.5}, id="clipped"),
    ],
)
def test_mirrored_equals_one_device_on_the_same_global_batch(kwargs, mirrored):
    x, y = data()
    strategy = mirrored
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    # Dropout would draw different masks per replica; compare without it.
    one = make(**kwargs)
    one.get_layer(index=1).layer.layers[1].rate = 0.0
    one.fit(dataset, epochs=2, verbose=0)
    with strategy.scope():
        two = make(**kwargs)
        two.get_layer(index=1).layer.layers[1].rate = 0.0
    two.fit(dataset, epochs=2, verbose=0)
    assert max_rel_diff([v.numpy() for v in one.weights], [v.numpy() for v in two.weights]) < TOL
    assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy())
    for variable in two.trainable_weights:
        assert isinstance(variable.value, tf.distribute.DistributedValues) or hasattr(
            variable.value, "values"
        )


def test_a_nonfinite_replica_skips_the_step_on_every_replica(mirrored):
    x, y = data(32)
    strategy = mirrored
    with strategy.scope():
        model = make()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # build and warm up
    before = [v.numpy() for v in model.weights + model.optimizer.variables]
    iterations = int(model.optimizer.iterations.numpy())
    bad = x[:16].copy()
    bad[12] = np.nan  # in the second replica's half of the global batch
    model.fit(bad, y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False)
    after = [v.numpy() for v in model.weights + model.optimizer.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations.numpy()) == iterations
    assert model.skipped_steps == 1


def test_accumulation_under_mirrored_strategy_is_refused_with_the_alternative(mirrored):
    strategy = mirrored
    with strategy.scope():
        with pytest.raises(ValueError, match="accumulation_steps=2 cannot run under MirroredStrategy.*micro_batch_size"):
            make(accumulation_steps=2)


# Started by kvram launch (TF_CONFIG, KVRAM_LAUNCH_ATTEMPT): argv = out folder, repository, kvram.Model kwargs
SETUP = r'''
import json, os, signal, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
sys.path.insert(0, sys.argv[2])
import numpy as np, tensorflow as tf, keras
keras.config.disable_traceback_filtering()
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
attempt = int(os.environ["KVRAM_LAUNCH_ATTEMPT"])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
from tests.test_distribute import make, data
x, y = data()
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).with_options(options)
with strategy.scope():
    model = make(**json.loads(sys.argv[3]))
    model.get_layer(index=1).layer.layers[1].rate = 0.0
'''

WORKER = SETUP + r'''
history = model.fit(dataset, epochs=2, verbose=0, validation_data=dataset)
np.savez(os.path.join(sys.argv[1], f"w{index}.npz"), *[v.numpy() for v in model.weights],
         replicas=strategy.num_replicas_in_sync, skipped=model.skipped_steps,
         val_loss=history.history["val_loss"], evaluated=model.evaluate(dataset, verbose=0),
         predicted=model.predict(dataset, verbose=0))
'''


def launch_workers(tmp_path, script, kwargs, **options):
    """Two workers of `script` on the CPU through kvram launch; asserts they succeeded."""
    import io
    import json
    import os
    import sys

    from kvram.parallel import _launch as launch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "worker.py"
    path.write_text(script)
    out = io.StringIO()
    code = launch.launch([sys.executable, str(path), str(tmp_path), root, json.dumps(kwargs)], 2,
                         gpus="none", out=out, **options)
    assert code == 0, out.getvalue()[-12000:]
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"micro_batch_size": 3, "clip_global_norm": 0.5}, id="micro_batches_clipped"),
        # extended: the two workers' strategy, launch and fit() are the case above's; the plain
        # step under a strategy is test_mirrored_equals_one_device_on_the_same_global_batch's
        pytest.param({}, id="plain", marks=pytest.mark.extended),
    ],
)
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_multi_worker_mirrored_two_processes_equal_one_device(tmp_path, kwargs, request):
    """Two worker processes (one CPU each, started by kvram launch) under
    MultiWorkerMirroredStrategy train a checkpointed kvram.Model (with
    micro-batching and clipping, and without) to the same weights as one device
    on the same global batch, with the same validation losses, evaluate() loss
    and predictions: Keras 3's fit() and evaluate() alone fail there
    (keras-team/keras#20585)."""
    if in_own_process(request):
        return
    launch_workers(tmp_path, WORKER, kwargs)
    x, y = data()
    one = make(**kwargs)
    one.get_layer(index=1).layer.layers[1].rate = 0.0
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    history = one.fit(dataset, epochs=2, verbose=0, validation_data=dataset)
    expected = [v.numpy() for v in one.weights]
    evaluated = one.evaluate(dataset, verbose=0)
    # rows in a canonical order: each worker's share of a batch comes back in its own order
    predicted = np.sort(one.predict(dataset, verbose=0), axis=0)
    for i in range(2):
        saved = np.load(tmp_path / f"w{i}.npz")
        assert int(saved["replicas"]) == 2 and int(saved["skipped"]) == 0
        got = [saved[f"arr_{j}"] for j in range(len(expected))]
        assert max_rel_diff(expected, got) < TOL
        np.testing.assert_allclose(saved["val_loss"], history.history["val_loss"], rtol=TOL)
        np.testing.assert_allclose(float(saved["evaluated"]), evaluated, rtol=TOL)
        np.testing.assert_allclose(np.sort(saved["predicted"], axis=0), predicted, rtol=1e-4, atol=1e-6)


RESUMING_WORKER = SETUP + r'''

class Die(keras.callbacks.Callback):
    # worker 1 is killed in its first attempt after the third epoch's first step: both
    # workers have finished their backups of epoch 2 by then (that step needed both)
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if attempt == 0 and index == 1 and self.epoch == 2 and batch == 0:
            os.kill(os.getpid(), signal.SIGKILL)


# one backup folder per worker: Keras's callback knows nothing of workers, and two
# writers of one .h5 file would corrupt it; every worker holds the same weights
backup = keras.callbacks.BackupAndRestore(os.path.join(sys.argv[1], f"backup{index}"))
history = model.fit(dataset, epochs=4, verbose=0, callbacks=[backup, Die()])
np.savez(os.path.join(sys.argv[1], f"w{index}.npz"), *[v.numpy() for v in model.weights],
         epochs_run=len(history.history["loss"]), iterations=int(model.optimizer.iterations.numpy()))
'''


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{"micro_batch_size": 3}], ids=["micro_batches"])
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
@pytest.mark.longest
def test_multi_worker_killed_worker_resumes_to_the_same_weights(tmp_path, kwargs, request):
    """kvram launch restarts both workers after one is SIGKILLed in the third of
    four epochs; keras.callbacks.BackupAndRestore resumes them from the second
    epoch's backup, and they end with the weights of an uninterrupted run on
    one device (1e-5), having run the last two epochs again."""
    if in_own_process(request):
        return
    out = launch_workers(tmp_path, RESUMING_WORKER, kwargs, max_restarts=1, grace_seconds=5)
    assert "[kvram launch] worker 1 was killed by SIGKILL: stopping the others" in out
    x, y = data()
    one = make(**kwargs)
    one.get_layer(index=1).layer.layers[1].rate = 0.0
    one.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=4, verbose=0)
    expected = [v.numpy() for v in one.weights]
    for i in range(2):
        saved = np.load(tmp_path / f"w{i}.npz")
        assert int(saved["epochs_run"]) == 2  # resumed at the third epoch
        assert int(saved["iterations"]) == int(one.optimizer.iterations.numpy())
        got = [saved[f"arr_{j}"] for j in range(len(expected))]
        assert max_rel_diff(expected, got) < TOL


def test_static_shapes_reads_distributed_batches(mirrored):
    """Under a strategy a batch reaches kvram's train function as distributed
    values (PerReplica), one tensor per local replica. Checking their shapes for
    the XLA step raised AttributeError: seen with two MultiWorkerMirroredStrategy
    workers under jit_compile on two H200s (benchmarks/results/distribute_2xh200.json)
    and on the CPU with `benchmarks/distribute/bench.py --cpu --jit --configs mwms`,
    which then stops at XLA's missing CPU collectives (b/194942685)."""
    from kvram.training._train_function import _static_shapes

    per_replica = mirrored.experimental_distribute_values_from_function(lambda ctx: tf.zeros((2, 3)))
    assert isinstance(per_replica, tf.distribute.DistributedValues)
    assert _static_shapes((per_replica, None, tf.zeros((4,))))


@pytest.mark.slow
@pytest.mark.parametrize(
    "micro_batch_size, loss_scale, keras_step",
    [(None, False, True), (4, False, False), (None, True, True), (None, False, False)],
    ids=["keras_step", "kvram_step", "loss_scale", "kvram_whole_batch"],
)
def test_mirrored_xla_step_traces_as_on_gpus(mirrored, monkeypatch, micro_batch_size, loss_scale, keras_step):
    """On GPUs under `jit_compile`, MirroredStrategy compiles each replica's step
    as its own XLA function and takes no merge_call in it. Tracing that step
    failed on two H200s (benchmarks/results/distribute_2xh200.json) with "merge_call
    called while defining a new graph": the optimizer's step count and kvram's
    counters (aggregation ONLY_FIRST_REPLICA) are updated by a merge_call, which
    may not sit in a cond (kvram's skip of a non-finite step; Keras's
    LossScaleOptimizer's, so plain Keras with mixed_float16 fails there too:
    keras-team/keras#17187). Here the GPU-device check MirroredStrategy makes is
    patched, so two logical CPUs trace the GPUs' path; the step is traced, not
    run (XLA on the CPU cannot run one function per logical CPU: each reads
    the other's variables)."""
    from tensorflow.python.distribute import mirrored_run, mirrored_strategy

    from kvram.training import _step, _train_function

    x, y = data()
    with mirrored.scope():
        model = make(micro_batch_size=micro_batch_size)
        optimizer = keras.optimizers.SGD(0.1)
        if loss_scale:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds every variable
    # (strategy.run's own check: on other devices it would lift a compiled
    # replica function to compile the whole run)
    for module in (mirrored_strategy, mirrored_run):
        monkeypatch.setattr(module, "_is_gpu_device", lambda device: True)
    model.jit_compile = True
    batch = next(iter(mirrored.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    )))
    if keras_step:  # Keras's own step, compiled per replica
        replica_step = tf.function(model.train_step, jit_compile=True)
        step = tf.function(lambda data: mirrored.run(replica_step, args=(data,)))
    else:
        # Under XLA over several local devices kvram's step runs, micro-batched
        # or not: Keras's compiles strategy.run whole, which XLA places on one
        # GPU (two H200s, benchmarks/results/distribute_2xh200_keras_step.json)
        model.make_train_function(force=True)
        assert isinstance(model.train_function, _train_function.TrainFunction)
        step = model.train_function._fused(micro_batch_size, batch)
    concrete = step.get_concrete_function(batch)
    # one XLA computation per replica, each on its replica's device
    assert _compiled_call_devices(concrete) == ["CPU:0", "CPU:1"]
    graph = concrete.graph
    ops = {op.type for f in graph._functions.values() for op in f.graph.get_operations()}
    assert "CollectiveReduceV2" in ops, sorted(ops)  # all-reduced without merge_call
    held = _step.step_state_variables(model, model._step_state)
    assert any(v is model.optimizer.iterations.value for v in held)
    # kvram's counters are tf.Variables (their `value` is a method): held too.
    # Missed, their update took a merge_call on two H200s (benchmarks/results/distribute_2xh200*.json)
    assert all(any(v is c for v in held) for c in model._step_state.counters())
    # the aggregation is only changed while tracing
    assert all(
        v.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA
        for v in [model._step_state.skipped, model.optimizer.iterations.value]
    )


def test_mirrored_xla_evaluate_compiles_each_replica(mirrored, monkeypatch):
    """evaluate() (and fit()'s validation) under XLA over several local devices:
    Keras compiles `strategy.run` whole, as in its train step, which on two
    H200s failed (one computation on GPU:0 reading replica 1's variables:
    benchmarks/results/distribute_2xh200_keras_step.json). kvram.Model compiles
    each replica's test step inside `strategy.run`, on that replica's device,
    as Keras compiles its predict step. Traced with MirroredStrategy's GPU
    checks patched (as above; and strategy.run's, which on other devices would
    lift a compiled function to compile the whole run), then evaluated without
    XLA on the two logical CPUs."""
    from tensorflow.python.distribute import mirrored_run, mirrored_strategy

    x, y = data()
    with mirrored.scope():
        model = make()
    model.evaluate(x, y, batch_size=16, verbose=0)  # builds (jit_compile "auto": off on the CPU)
    for module in (mirrored_strategy, mirrored_run):
        monkeypatch.setattr(module, "_is_gpu_device", lambda device: True)
    model.jit_compile = True
    model.make_test_function(force=True)
    batch = next(iter(mirrored.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    )))
    assert _compiled_call_devices(model.test_function.step.get_concrete_function(batch)) == ["CPU:0", "CPU:1"]
    monkeypatch.undo()
    model.jit_compile = False
    model.make_test_function(force=True)
    assert np.isfinite(model.evaluate(x, y, batch_size=16, verbose=0))


def _compiled_call_devices(concrete):
    """The devices of the XLA-compiled functions `concrete` calls; [] where it
    is itself compiled whole (strategy.run in one computation)."""
    if concrete.function_def.attr["_XlaMustCompile"].b:
        return []
    graph = concrete.graph
    compiled = {name for name, f in graph._functions.items() if f.definition.attr["_XlaMustCompile"].b}
    calls = [op for op in graph.get_operations()
             if op.type in ("StatefulPartitionedCall", "PartitionedCall") and op.get_attr("f").name in compiled]
    return sorted(tf.DeviceSpec.from_string(op.device).to_string()[-5:] for op in calls)


def test_updated_in_each_replica_keeps_the_copies_equal(mirrored):
    """Inside, each replica updates its own copy of an ONLY_FIRST_REPLICA
    variable (no merge_call), so every replica's step count moves alike."""
    from kvram.training._step import updated_in_each_replica

    with mirrored.scope():
        count = tf.Variable(
            0, dtype=tf.int64, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
        )

    @tf.function
    def step():
        def replica():
            with updated_in_each_replica([count]):
                assert count.aggregation == tf.VariableAggregation.NONE
                count.assign_add(1)

        mirrored.run(replica)

    step()
    step()
    assert [int(v.numpy()) for v in mirrored.experimental_local_results(count)] == [2, 2]
    assert count.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA
