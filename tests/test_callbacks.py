import csv
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.training import _train_function
from kvram.callbacks import AdaptiveBatchSize, MemoryLogger, find_max_batch_size
from tests.helpers import gradients_failing_every, in_own_process, max_rel_diff

TOL = 1e-5
N = 96  # samples


class InjectedOOM(keras.layers.Layer):
    """Raises ResourceExhaustedError, as TF does on the GPU when memory runs out.

    On the CPU a real allocation failure takes minutes to surface, and as
    InvalidArgumentError, so tests inject it: when a slice has more than `rows`
    rows, or on the calls whose index is in `fail_calls`. The model runs eagerly
    so that the layer sees concrete shapes.
    """

    def __init__(self, rows=None, fail_calls=(), **kwargs):
        super().__init__(**kwargs)
        self.rows = rows
        self.fail_calls = set(fail_calls)
        self.calls = 0
        self.raised = 0

    def call(self, x):
        if tf.executing_eagerly():
            index = self.calls
            self.calls += 1
            if index in self.fail_calls or (self.rows is not None and x.shape[0] > self.rows):
                self.raised += 1
                raise tf.errors.ResourceExhaustedError(
                    None, None, f"OOM when allocating tensor with shape[{x.shape[0]},16] (injected)"
                )
        return x


class CountSamples(keras.layers.Layer):
    """Counts, in a non-trainable variable, how often each sample id went forward."""

    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def build(self, input_shape):
        self.seen = self.add_weight(
            shape=(self.n,), initializer="zeros", trainable=False, name="seen"
        )

    def call(self, ids):
        counts = tf.math.bincount(tf.cast(tf.reshape(ids, [-1]), tf.int32), minlength=self.n,
                                  maxlength=self.n, dtype=tf.float32)
        self.seen.assign_add(counts)
        return ids


def network(
    oom=None, eager=False, accumulation_steps=1, micro_batch_size=None, metrics=True, width=16, host_offload=False
):
    """Dense net on (features, id); the id only feeds the sample counter.

    The counter runs before the OOM layer, so every failed attempt has already
    changed a variable that the recovery must put back.
    """
    keras.utils.set_random_seed(5)
    features = keras.Input((8,), name="features")
    ids = keras.Input((1,), name="id")
    count = CountSamples(N, name="count")(ids)
    x = keras.layers.Dense(width, activation="tanh")(features)
    if oom is not None:
        x = oom(x)
    x = keras.layers.Dense(3)(x)
    outputs = keras.layers.Add()([x, 0.0 * count])
    net = kvram.Model(
        [features, ids],
        outputs,
        accumulation_steps=accumulation_steps,
        micro_batch_size=micro_batch_size,
        host_offload=host_offload,
    )
    net.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="mse",
        metrics=["mae"] if metrics else None,
        run_eagerly=eager,
    )
    return net


def dataset(batch=16):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 8)).astype("float32")
    y = rng.standard_normal((N, 3)).astype("float32")
    ids = np.arange(N, dtype="float32")[:, None]
    return tf.data.Dataset.from_tensor_slices(((x, ids), y)).batch(batch)


def weights(net):
    return [v.numpy() for v in net.trainable_weights]


def seen(net):
    return net.get_layer("count").seen.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_fit_survives_injected_ooms_and_equals_an_uninterrupted_run(accumulation_steps):
    epochs, steps = 3, N // 16
    plain = network(accumulation_steps=accumulation_steps)
    h_plain = plain.fit(dataset(), epochs=epochs, verbose=0)

    # Slices above 5 rows fail (16 -> 8 -> 4), plus failures at chosen calls.
    oom = InjectedOOM(rows=5, fail_calls={9, 30, 31, 77})
    net = network(oom, eager=True, accumulation_steps=accumulation_steps)
    controller = AdaptiveBatchSize(verbose=0, device="CPU:0")
    history = net.fit(dataset(), epochs=epochs, verbose=0, callbacks=[controller])

    # 16 -> 8 -> 4 by size; call 9 fails at 4 (-> 2), call 30 at 2 (-> 1), then
    # calls 31 and 77 fail at the minimum and are retried at 1.
    assert oom.raised == controller.oom_count == 6
    assert net.micro_batch_size == 1
    assert max_rel_diff(weights(plain), weights(net)) < TOL
    for a, b in zip(plain.optimizer.variables, net.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=TOL, atol=1e-6)
    # Exactly once per epoch: the failed attempts' counts were rolled back.
    np.testing.assert_array_equal(seen(net), np.full(N, epochs))
    np.testing.assert_array_equal(seen(plain), np.full(N, epochs))
    updates = epochs * steps // accumulation_steps
    assert int(net.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    assert int(net.inner_optimizer.iterations.numpy()) == updates
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], h_plain.history[key], rtol=TOL)
    kinds = [e.kind for e in controller.events]
    assert kinds == ["start"] + ["oom"] * 6
    assert [e.new for e in controller.events] == [16, 8, 4, 2, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_out_of_memory_recovery_with_the_optimizer_on_the_host(request):
    """AdaptiveBatchSize's recovery under host_offload: the failed passes change no host state, and
    the run ends where a plain one without failures does."""
    if in_own_process(request):
        return
    plain = network(accumulation_steps=2)
    plain.fit(dataset(), epochs=2, verbose=0)
    oom = InjectedOOM(rows=5, fail_calls={9, 30})
    net = network(oom, eager=True, accumulation_steps=2, host_offload=True)
    controller = AdaptiveBatchSize(verbose=0, device="CPU:0")
    net.fit(dataset(), epochs=2, verbose=0, callbacks=[controller])
    assert oom.raised == controller.oom_count > 0
    assert max_rel_diff(weights(plain), weights(net)) < TOL
    np.testing.assert_array_equal(seen(net), np.full(N, 2))
    assert int(net.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_a_hundred_ooms_in_one_fit(request):
    if in_own_process(request):
        return
    epochs = 9
    plain = network(metrics=False)
    plain.fit(dataset(8), epochs=epochs, verbose=0)
    # Slices above 5 rows fail (8 -> 4, the minimum); then every third call
    # fails too, so each batch of two slices fails once and is run again.
    oom = InjectedOOM(rows=5, fail_calls={i for i in range(0, 10_000, 3)})
    net = network(oom, eager=True, metrics=False)
    controller = AdaptiveBatchSize(min_micro_batch=4, verbose=0, device="CPU:0")
    net.fit(dataset(8), epochs=epochs, verbose=0, callbacks=[controller])
    assert controller.oom_count >= 100
    assert max_rel_diff(weights(plain), weights(net)) < TOL
    np.testing.assert_array_equal(seen(net), np.full(N, epochs))
    assert int(net.optimizer.iterations.numpy()) == epochs * N // 8


@pytest.mark.slow  # 6.6 s in the fast tier on 2 cores
def test_recovery_from_a_compiled_step_restores_graph_written_state(monkeypatch):
    """OOMs raised after the compiled gradient pass ran (and wrote BN statistics,
    the sample counter and metrics in graph mode): all of it is put back."""
    plain = bn_network(momentum=0.0)
    h_plain = plain.fit(dataset(), epochs=2, verbose=0)
    net = bn_network(momentum=0.0)
    failing = gradients_failing_every(3, _train_function.TrainFunction._gradients)
    monkeypatch.setattr(_train_function.TrainFunction, "_gradients", failing)
    # micro-batch stays at the batch: min_micro_batch = 16 retries in place.
    controller = AdaptiveBatchSize(min_micro_batch=16, verbose=0, device="CPU:0")
    history = net.fit(dataset(), epochs=2, verbose=0, callbacks=[controller])
    assert controller.oom_count == N // 16  # calls 1, 4, 7, ...: every other step
    for a, b in zip(plain.variables, net.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=TOL, atol=1e-6, err_msg=a.path)
    np.testing.assert_allclose(history.history["mae"], h_plain.history["mae"], rtol=TOL)


def test_gives_up_with_a_clear_error_after_retries_at_the_minimum():
    oom = InjectedOOM(rows=0)  # nothing fits
    net = network(oom, eager=True)
    before = weights(net)
    with pytest.raises(RuntimeError, match=r"smallest micro-batch \(1 rows\), 3 times"):
        net.fit(dataset(), epochs=1, verbose=0, callbacks=[AdaptiveBatchSize(max_retries=2, verbose=0, device="CPU:0")])
    assert max_rel_diff(before, weights(net)) == 0
    assert int(net.optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(seen(net), np.zeros(N))


def test_other_errors_are_not_taken_for_ooms():
    class Broken(keras.layers.Layer):
        def call(self, x):
            if tf.executing_eagerly():
                raise tf.errors.InvalidArgumentError(None, None, "a real bug")
            return x

    net = network(Broken(), eager=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="a real bug"):
        net.fit(dataset(), epochs=1, verbose=0, callbacks=[AdaptiveBatchSize(verbose=0, device="CPU:0")])


def test_is_out_of_memory():
    assert kvram.memory.is_out_of_memory(tf.errors.ResourceExhaustedError(None, None, "x"))
    assert kvram.memory.is_out_of_memory(
        tf.errors.InternalError(None, None, "Dst tensor is not initialized.")
    )
    assert not kvram.memory.is_out_of_memory(tf.errors.InternalError(None, None, "cuDNN"))
    assert not kvram.memory.is_out_of_memory(ValueError("out of memory"))


class FakeMemory:
    """Device memory of a model whose step peaks at base + per_row * micro-batch."""

    def __init__(self, model, base=1000, per_row=100):
        self.model, self.base, self.per_row = model, base, per_row
        self.peaks = []

    def current(self, device=None):
        return self.base

    def peak(self, device=None):
        value = self.base + self.per_row * self.model.micro_batch_size
        self.peaks.append(value)
        return value

    def install(self, monkeypatch):
        monkeypatch.setattr(kvram.memory, "current_bytes", self.current)
        monkeypatch.setattr(kvram.memory, "peak_bytes", self.peak)
        monkeypatch.setattr(kvram.memory, "reset_peak", lambda device=None: None)
        return self


def test_rungs_are_equal_slices():
    from kvram.callbacks import rungs

    assert rungs(16) == [16, 8, 6, 4, 3, 2, 1]
    assert rungs(512)[:8] == [512, 256, 171, 128, 103, 86, 74, 64]
    assert rungs(96, low=5, high=40) == [32, 24, 20, 16, 14, 12, 11, 10, 9, 8, 7, 6, 5]
    for rows in (7, 96, 100, 512, 1000):
        for m in rungs(rows):
            slices = -(-rows // m)
            assert m == -(-rows // slices)  # no smaller size runs as few slices
    assert len(rungs(512)) <= 2 * 512**0.5 + 2


@pytest.mark.parametrize(
    "start, probe, fake, limit, expected, kinds",
    [
        # 4 -> 8 -> 16 -> 32 -> 48 (at most doubling, on equal slices of 96 rows);
        # 96 would peak at 10600 > 8500, the target.
        (4, True, (1000, 100), 10_000, 48, ["grow"] * 4),
        # No probe: the whole batch peaks at 10600 > 8500: shrinks to the largest
        # size predicted to fit (75), rounded down to equal slices (48).
        (None, False, (1000, 100), 10_000, 48, ["start", "shrink"]),
        # Probes at 3 and 6 rows predict the first size: the largest that fits
        # (84 rows: 1000 + 10_000 * 84 <= 850_000) on equal slices is 48.
        (None, True, (1000, 10_000), 1_000_000, 48, ["probe", "probe", "start"]),
    ],
)
def test_headroom_grows_and_shrinks_the_micro_batch(
    monkeypatch, start, probe, fake, limit, expected, kinds
):
    net = network(micro_batch_size=start)
    memory = FakeMemory(net, *fake).install(monkeypatch)
    controller = AdaptiveBatchSize(
        memory_limit=limit, target_utilization=0.85, probe=probe, verbose=0
    )
    net.fit(dataset(N).repeat(12), epochs=1, verbose=0, callbacks=[controller])
    assert net.micro_batch_size == expected
    assert [e.kind for e in controller.events] == kinds
    after_last_change = memory.peaks[-3:]
    assert all(p <= 0.85 * limit for p in after_last_change)
    assert controller.oom_count == 0
    if probe and start is None:
        assert [e.new for e in controller.events[:2]] == [3, 6]  # 96 // 32 and twice that
        assert controller.events[2].predicted_bytes == 1000 + 10_000 * 48 - 96 * 48 + 48 * 96


@pytest.mark.parametrize("limit, kinds", [(6500, []), (6200, ["shrink"])])
def test_a_peak_a_little_over_the_target_keeps_the_size(monkeypatch, limit, kinds):
    """Micro-batch 48 peaks at 5800. Limit 6500: over the target (5525) but under
    the shrink line halfway to the limit (6012.5): kept. Limit 6200: over its
    shrink line (5735): shrinks to a size predicted under the target."""
    net = network(micro_batch_size=48)
    FakeMemory(net, base=1000, per_row=100).install(monkeypatch)
    controller = AdaptiveBatchSize(memory_limit=limit, target_utilization=0.85, verbose=0)
    net.fit(dataset(N).repeat(6), epochs=1, verbose=0, callbacks=[controller])
    assert [e.kind for e in controller.events] == kinds
    if kinds:
        assert net.micro_batch_size == 32  # 1000 + 100 * 32 = 4200 <= 5270
        assert controller.events[0].peak_bytes == 5800
    else:
        assert net.micro_batch_size == 48


class FakeClock:
    """Probe timings: a slice shape's first run costs `shape_seconds`, a slice of
    m rows 0.05 + m / 60 seconds."""

    def __init__(self, monkeypatch, shape_seconds):
        self.now, self.seen, self.shape_seconds = 0.0, set(), shape_seconds
        original = _train_function.TrainFunction._probe

        def probe(train_function, function, data, size, rows_used):
            ok = original(train_function, function, data, size, rows_used)
            if size not in self.seen:
                self.seen.add(size)
                self.now += self.shape_seconds
            self.now += (rows_used // size) * (0.05 + size / 60)
            return ok

        monkeypatch.setattr(_train_function.TrainFunction, "_probe", probe)

    def __call__(self):
        return self.now


@pytest.mark.parametrize(
    "shape_seconds, repeats, expected",
    [
        # 48 (two slices) would save 11 * (16 * 0.15 - 2 * 0.85) = 7.7 s over the
        # remaining 11 steps, less than its new shape's 30 s: 6 (probed, 16 slices).
        (30.0, 12, 6),
        # Same, 99 steps left: 69 s saved > 30 s: the largest size that fits.
        (30.0, 100, 48),
        # New shapes costing under a second are not weighed: the largest.
        (0.5, 12, 48),
    ],
)
def test_new_slice_shapes_are_taken_only_when_they_pay_for_their_autotuning(
    monkeypatch, shape_seconds, repeats, expected
):
    net = network()
    FakeMemory(net, 1000, 10_000).install(monkeypatch)
    clock = FakeClock(monkeypatch, shape_seconds)
    controller = AdaptiveBatchSize(memory_limit=1_000_000, verbose=0)
    controller._clock = clock
    net.fit(dataset(N).repeat(repeats), epochs=1, verbose=0, callbacks=[controller])
    assert [e.kind for e in controller.events] == ["probe", "probe", "start"]  # no growth later
    assert net.micro_batch_size == expected
    assert controller._shape_seconds == pytest.approx(shape_seconds)


def test_hysteresis_no_change_for_less_than_ten_percent(monkeypatch):
    from kvram.callbacks import rungs

    assert 13 in rungs(100) and 15 in rungs(100) and 14 not in rungs(100)
    for limit, expected in ((16, 12), (18, 15)):  # targets 13.6 and 15.3 rows
        net = network(micro_batch_size=12)
        FakeMemory(net, base=0, per_row=1).install(monkeypatch)
        controller = AdaptiveBatchSize(memory_limit=limit, verbose=0)
        data = tf.data.Dataset.from_tensor_slices(
            ((np.ones((100, 8), "float32"), np.zeros((100, 1), "float32")), np.ones((100, 3), "float32"))
        ).batch(100).repeat(6)
        net.fit(data, epochs=1, verbose=0, callbacks=[controller])
        # 12 -> 13 would gain 8%: not worth a change; 12 -> 15 gains 25%.
        assert net.micro_batch_size == expected


@pytest.mark.slow
@pytest.mark.own_process
def test_headroom_with_real_cpu_allocator_stats(request):
    if in_own_process(request):  # run ahead, beside the suite (tests/helpers.py)
        return
    keras.utils.set_random_seed(0)
    with tf.device("CPU:0"):  # the model, its variables and its steps (also on a GPU machine)
        inputs = keras.Input((64,))
        x = inputs
        for _ in range(3):
            x = keras.layers.Dense(512, activation="relu")(x)
        net = kvram.Model(inputs, keras.layers.Dense(1)(x), micro_batch_size=8)
        net.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensors((tf.ones((1024, 64)), tf.ones((1024, 1)))).repeat(12)
    with tf.device("CPU:0"):
        roomy = AdaptiveBatchSize(memory_limit=2**30, device="CPU:0", verbose=0)
        net.fit(data, epochs=1, verbose=0, callbacks=[roomy])
        assert net.micro_batch_size > 8 and {e.kind for e in roomy.events} == {"grow"}
        kvram.memory.reset_peak("CPU:0")
        floor = kvram.memory.current_bytes("CPU:0")
        tight = AdaptiveBatchSize(memory_limit=floor + 2**20, device="CPU:0", verbose=0)
        grown = net.micro_batch_size
        net.fit(data, epochs=1, verbose=0, callbacks=[tight])
        assert net.micro_batch_size < grown and "shrink" in {e.kind for e in tight.events}


def test_adaptive_batch_size_needs_a_kvram_model():
    inputs = keras.Input((8,))
    net = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    net.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="needs a kvram.Model"):
        net.fit(np.ones((8, 8)), np.ones((8, 1)), verbose=0, callbacks=[AdaptiveBatchSize(device="CPU:0")])


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"min_micro_batch": 0}, ValueError, "min_micro_batch=0"),
        ({"min_micro_batch": 8, "max_micro_batch": 4}, ValueError, "max_micro_batch=4"),
        ({"target_utilization": 1.5}, ValueError, "target_utilization=1.5"),
        ({"target_utilization": 0}, ValueError, "target_utilization=0"),
        ({"memory_limit": "16G"}, TypeError, "memory_limit='16G'"),
        ({"max_retries": -1}, ValueError, "max_retries=-1"),
        ({"device": "TPU:0"}, ValueError, "device='TPU:0'"),
    ],
)
def test_adaptive_batch_size_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        AdaptiveBatchSize(**kwargs)


def test_one_controller_per_fit():
    net = network()
    with pytest.raises(ValueError, match="at most one AdaptiveBatchSize"):
        net.fit(dataset(), verbose=0, callbacks=[AdaptiveBatchSize(device="CPU:0"), AdaptiveBatchSize(device="CPU:0")])


# find_max_batch_size ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1, 2, 37, 100, 500, 700, 1023, 5000])
@pytest.mark.parametrize("high", [1024, None])
def test_find_max_batch_size_on_a_synthetic_cap(cap, high):
    low, margin = 1, 0.1
    if high is None and cap > 1024:
        pytest.skip("unbounded growth is checked on smaller caps")
    net = network(InjectedOOM(rows=cap), eager=True)
    before = [v.numpy() for v in net.variables + net.optimizer.variables]
    rng = np.random.default_rng(1)
    sample = ((rng.standard_normal((10, 8)), np.arange(10.0)[:, None]), rng.standard_normal((10, 3)))
    size, probes = find_max_batch_size(net, sample, low=low, high=high, margin=margin, verbose=0)
    true_max = cap if high is None else min(cap, high)
    assert size <= true_max and size >= (1 - margin) * true_max, (size, probes)
    bound = math.ceil(math.log2((high or 2 * true_max) / low)) + 3
    assert len(probes) <= bound, probes
    assert all(p["fits"] == (p["size"] <= cap) for p in probes)
    # The model is as before: weights, optimizer state and counters.
    after = [v.numpy() for v in net.variables + net.optimizer.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert net.micro_batch_size is None


def test_find_max_batch_size_when_nothing_fits():
    net = network(InjectedOOM(rows=3), eager=True)
    sample = ((np.ones((2, 8)), np.zeros((2, 1))), np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="not even low=4 rows fit"):
        find_max_batch_size(net, sample, low=4, verbose=0)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"low": 0}, ValueError, "low=0"),
        ({"low": 8, "high": 4}, ValueError, r"^`high` must be >= `low`\. Received: low=8, high=4$"),
        ({"margin": 1.0}, ValueError, "margin=1.0"),
    ],
)
def test_find_max_batch_size_bad_arguments(kwargs, error, text):
    net = network()
    sample = ((np.ones((2, 8)), np.zeros((2, 1))), np.ones((2, 3)))
    with pytest.raises(error, match=text):
        find_max_batch_size(net, sample, verbose=0, **kwargs)


# MemoryLogger ---------------------------------------------------------------------


def test_memory_logger_writes_csv_tensorboard_and_png(tmp_path):
    from matplotlib import image

    oom = InjectedOOM(rows=5, fail_calls={40})
    logdir = tmp_path / "logs"
    controller = AdaptiveBatchSize(verbose=0, device="CPU:0")
    with tf.device("CPU:0"):  # measured on CPU:0, so run there (also on a GPU machine)
        net = network(oom, eager=True, width=4096)  # large enough for the CPU allocator's counts
        net.fit(
            dataset(),
            epochs=2,
            verbose=0,
            callbacks=[controller, MemoryLogger(logdir, device="CPU:0")],
        )
    steps = 2 * N // 16
    with open(logdir / "memory.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == steps
    assert tuple(rows[0]) == MemoryLogger.COLUMNS
    # TF's CPU allocator counts only its larger allocations: the first step's
    # 16-row attempt shows; the 4-row slices after it may not.
    assert all(int(r["peak_bytes"]) >= int(r["current_bytes"]) >= 0 for r in rows)
    assert int(rows[0]["peak_bytes"]) >= 16 * 4096 * 4
    sizes = [int(r["micro_batch_size"]) for r in rows]
    # 16 -> 8 -> 4 in the first step; call 40 fails at 4, and 2 is used from then on.
    assert sizes[0] == 4 and sizes[-1] == 2 and sizes == sorted(sizes, reverse=True)
    assert all(float(r["skipped_steps"]) == 0 for r in rows)

    with open(logdir / "events.csv") as handle:
        events = list(csv.DictReader(handle))
    assert [e["kind"] for e in events].count("oom") == controller.oom_count == 3
    assert all(float(e["seconds_to_error"]) >= 0 for e in events if e["kind"] == "oom")

    tags = {}
    for name in os.listdir(logdir):
        if name.startswith("events.out.tfevents"):
            for event in tf.compat.v1.train.summary_iterator(str(logdir / name)):
                for value in event.summary.value:
                    tags.setdefault(value.tag, []).append(event.step)
    assert tags["memory/peak_mib"] == list(range(steps))
    assert tags["batch/micro_batch_size"] == list(range(steps))
    assert "batch/loss" in tags and "memory/current_mib" in tags

    png = image.imread(logdir / "memory.png")
    assert png.ndim == 3 and png.shape[0] > 200 and png.shape[1] > 400
    assert png.std() > 0.01  # not a blank canvas


def test_memory_logger_bad_logdir(tmp_path):
    with pytest.raises(TypeError, match="logdir=3"):
        MemoryLogger(3)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError) as error:
        MemoryLogger(a_file)
    assert str(error.value) == (
        f"MemoryLogger cannot write its logs to {a_file}: it is a file, not a directory. "
        f"Received: logdir={str(a_file)!r}"
    )
    under = a_file / "logs" / "run1"
    with pytest.raises(ValueError) as error:
        MemoryLogger(under)
    assert str(error.value) == (
        f"MemoryLogger cannot write its logs to {under}: {a_file} is a file, so no "
        f"directory can be made under it. Received: logdir={str(under)!r}"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only directory")
def test_memory_logger_read_only_logdir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=f"{locked} is not writable by this process"):
        MemoryLogger(locked / "logs")


def test_memory_logger_write_failure_mid_fit_warns_and_training_goes_on(tmp_path):
    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    logger = MemoryLogger(tmp_path, device="CPU:0", plot=False)

    class BreakTheDisk(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                logger._file = FullDisk()
                logger._writer = csv.DictWriter(logger._file, fieldnames=logger.COLUMNS)

    net = network()
    with pytest.warns(UserWarning) as warned:
        net.fit(dataset(), epochs=1, verbose=0, callbacks=[BreakTheDisk(), logger])
    texts = [str(w.message) for w in warned if "MemoryLogger" in str(w.message)]
    assert texts == [
        f"MemoryLogger: writing to {tmp_path} failed at step 2 ([Errno 28] No space left "
        "on device); training goes on, and the rows are kept in memory (MemoryLogger.rows) "
        "but no longer written."
    ]
    assert int(net.optimizer.iterations.numpy()) == N // 16 and len(logger.rows) == N // 16
    assert (tmp_path / "memory.csv").read_text().count("\n") == 3  # header + steps 0 and 1


def test_growth_stays_below_a_size_that_failed(monkeypatch):
    """After an OOM at 48 with 32 known good, memory predicts that 48 and 96 fit,
    but no size at or above 48 is tried again."""
    net = network(micro_batch_size=48)
    FakeMemory(net, base=0, per_row=1).install(monkeypatch)  # everything seems to fit
    controller = AdaptiveBatchSize(memory_limit=10**9, verbose=0)
    controller.set_model(net)
    controller.on_train_begin()
    controller._rows, controller._good, controller._measure_next = 96, 32, True
    assert controller.recover(net, RuntimeError("oom"), 48, 96, 0.0) == 32
    sizes = []
    for _ in range(6):
        controller._measure_next = True
        controller.on_train_batch_begin(0)
        controller.on_train_batch_end(0)
        sizes.append(net.micro_batch_size)
    assert sizes == [32] * 6
    # Without a size known to work, an OOM halves onto the ladder: 96 -> 48.
    fresh = AdaptiveBatchSize(memory_limit=10**9, verbose=0)
    fresh.set_model(net)
    fresh.on_train_begin()
    fresh._rows = 96
    assert fresh.recover(net, RuntimeError("oom"), 96, 96, 0.0) == 48


def bn_network(micro_batch_size=None, momentum=0.9):
    """Dense + BatchNormalization + Dropout: state that a probe or a failed step writes."""
    keras.utils.set_random_seed(5)
    features = keras.Input((8,))
    ids = keras.Input((1,))
    count = CountSamples(N, name="count")(ids)
    x = keras.layers.Dense(16)(features)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.3)(x)
    x = keras.layers.Dense(3)(x)
    net = kvram.Model([features, ids], keras.layers.Add()([x, 0.0 * count]),
                      micro_batch_size=micro_batch_size)
    net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=momentum), loss="mse", metrics=["mae"])
    return net


def test_one_trace_for_every_micro_batch_and_batch_size(monkeypatch):
    """Sizes 3 -> 6 -> 10 -> 20 -> 40 (equal slices of 40 rows) and a short last
    batch each epoch: the compiled gradient pass and update are traced once each."""
    net = network(micro_batch_size=3)
    FakeMemory(net, base=0, per_row=1).install(monkeypatch)
    controller = AdaptiveBatchSize(memory_limit=10**9, verbose=0)
    data = dataset(40)  # batches of 40, 40, 16
    net.fit(data, epochs=6, verbose=0, callbacks=[controller])
    assert [e.new for e in controller.events] == [6, 10, 20, 40]
    assert net.train_function.tracing_count() == 2


def test_probes_leave_no_trace_and_updates_equal_plain_keras(monkeypatch):
    """Probes (compiled, on BatchNormalization, Dropout, metrics and a sample
    counter) put every state back: the run equals one at a fixed micro-batch."""
    plain = bn_network(micro_batch_size=48)
    h_plain = plain.fit(dataset(96), epochs=3, verbose=0)
    net = bn_network()
    FakeMemory(net, base=1000, per_row=10_000).install(monkeypatch)
    controller = AdaptiveBatchSize(memory_limit=1_000_000, verbose=0)
    history = net.fit(dataset(96), epochs=3, verbose=0, callbacks=[controller])
    assert [e.kind for e in controller.events] == ["probe", "probe", "start"]
    assert net.micro_batch_size == 48
    for a, b in zip(plain.variables, net.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=TOL, atol=1e-6, err_msg=a.path)
    np.testing.assert_array_equal(seen(net), np.full(N, 3))
    np.testing.assert_allclose(history.history["mae"], h_plain.history["mae"], rtol=TOL)


def test_memory_logger_without_matplotlib_warns_and_keeps_the_logs(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    net = network()
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        net.fit(dataset(), epochs=1, verbose=0, callbacks=[MemoryLogger(tmp_path, device="CPU:0")])
    assert (tmp_path / "memory.csv").is_file() and not (tmp_path / "memory.png").exists()
