"""Models saved by kvram 0.1.0 in its flat module layout (tests/fixtures,
written by tests/fixtures/make_saved_models.py) load and predict as saved."""

import os

import keras
import numpy as np
import pytest

import kvram

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize("name, kind", [("kvram-0.1.0-functional", kvram.Model),
                                        ("kvram-0.1.0-pipeline", kvram.parallel.PipelineModel)])
def test_a_model_saved_before_the_layout_loads_and_predicts_the_same(name, kind):
    model = keras.saving.load_model(os.path.join(FIXTURES, f"{name}.keras"))
    assert isinstance(model, kind)
    saved = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    np.testing.assert_allclose(model.predict(saved["x"], verbose=0), saved["y"], rtol=1e-6, atol=1e-6)
    if kind is kvram.Model:
        assert model.accumulation_steps == 2 and model.clip_global_norm == 1.0
        kinds = {type(layer).__name__ for layer in model.layers}
        assert {"Checkpoint", "FusedBatchNormalization", "MemoryEfficientAttention"} <= kinds
