"""Every path that measures a model runs training-mode steps on its variables
(BatchNormalization's moving statistics, Dropout's seed states) and may build
or step an optimizer; each puts everything back. A user who plans or sizes a
pretrained model before fine-tuning it loses nothing."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram import remat
from kvram.callbacks import AdaptiveBatchSize, find_max_batch_size

_LOSS = "sparse_categorical_crossentropy"
_ROWS = 64


class _AfterProbes(Exception):
    """Raised by the controller right after its probes, before the first step."""


def _stepped_model():
    """(model, optimizer, data): Dense, BatchNormalization and Dropout blocks, a
    kvram.Model whose Adam has stepped, so nothing measured is fresh."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = inputs
    for i in range(4):
        x = keras.layers.Dense(32, name=f"dense{i}")(x)
        x = keras.layers.BatchNormalization(name=f"norm{i}")(x)
        x = keras.layers.Dropout(0.2, name=f"drop{i}")(keras.layers.ReLU()(x))
    model = kvram.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(x))
    optimizer = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=optimizer, loss=_LOSS)
    data = (tf.random.normal((_ROWS, 16), seed=1), tf.constant(np.arange(_ROWS) % 3))
    model.fit(*data, batch_size=16, epochs=1, verbose=0)
    return model, optimizer, data


def _plan(model, optimizer, data):
    least = remat.plan(model, data, optimizer=optimizer, loss=_LOSS)
    least.with_budget((least.minimum_peak_bytes + least.plain_peak_bytes) // 2)
    least.check(((0, 1),))


def _estimate(model, optimizer, data):
    # `build` may hand back the caller's own model
    remat.estimate(lambda: model, _ROWS, memory_bytes=2**30, optimizer=optimizer, loss=_LOSS,
                   precisions=("float32",))


def _measure(model, optimizer, data):
    configuration = remat.Configuration(precision="float32", micro_batch_size=16, remat="none",
                                        predicted_peak_bytes=0, relative_step_time=1.0, fits=True)
    result = remat.measure(lambda: model, configuration, _ROWS, optimizer=optimizer, loss=_LOSS, steps=2)
    assert result["samples_per_second"] and result["plain"]["samples_per_second"], result  # both trained


def _find_max_batch_size(model, optimizer, data):
    found = find_max_batch_size(model, data, low=1, high=_ROWS, verbose=0)
    assert found.size == _ROWS, found


def _adaptive_probes(model, optimizer, data, monkeypatch):
    """fit()'s first step with AdaptiveBatchSize probes two micro-batch sizes,
    then stops before the step itself."""
    controller = AdaptiveBatchSize(memory_limit=2**30, device="CPU:0", verbose=0)
    begin_step = AdaptiveBatchSize.begin_step

    def probe_then_stop(self, *args, **kwargs):
        begin_step(self, *args, **kwargs)
        raise _AfterProbes

    monkeypatch.setattr(AdaptiveBatchSize, "begin_step", probe_then_stop)
    with pytest.raises(_AfterProbes):
        model.fit(*data, batch_size=_ROWS, epochs=1, verbose=0, callbacks=[controller])
    assert [e.kind for e in controller.events] == ["probe", "probe", "start"], controller.events


PATHS = {
    "plan_with_budget_and_check": _plan,
    "estimate": _estimate,
    "measure": _measure,
    "find_max_batch_size": _find_max_batch_size,
    "adaptive_batch_size_probes": _adaptive_probes,
}


@pytest.mark.slow  # 2-7 s each on 2 cores
@pytest.mark.parametrize("path", sorted(PATHS))
def test_measuring_leaves_the_model_and_its_optimizer_bit_identical(path, monkeypatch):
    model, optimizer, data = _stepped_model()
    variables = model.variables + optimizer.variables
    assert any("moving_mean" in v.path for v in variables) and any("seed" in v.path for v in variables)
    assert int(optimizer.iterations.numpy()) > 0
    before = [v.numpy().copy() for v in variables]
    run = PATHS[path]
    if path == "adaptive_batch_size_probes":
        run(model, optimizer, data, monkeypatch)
    else:
        run(model, optimizer, data)
    changed = [v.path for v, old in zip(variables, before) if not np.array_equal(old, v.numpy())]
    assert not changed, f"{path} changed {changed}"
    assert model.optimizer is optimizer
    assert [id(v) for v in model.variables + optimizer.variables] == [id(v) for v in variables]
