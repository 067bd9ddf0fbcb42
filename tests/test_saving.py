"""Everything kvram can put into a user's model (its layers and models, the classes
`kvram.speed` swaps in, the activations it sets) round-trips through `model.save`
and `keras.saving.load_model` in a process that imports nothing but kvram (and
Keras, numpy). The classes are found by walking the package, not listed: a new
one without a way to build it here fails `test_every_saveable_kvram_class_has_a_builder`."""

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import keras
import numpy as np
import pytest

import kvram
from keras.src.saving.keras_saveable import KerasSaveable


def _kvram_classes() -> set:
    """Every KerasSaveable class (layer, model, optimizer, loss, metric...) a kvram module defines."""
    found = set()
    for info in pkgutil.walk_packages(kvram.__path__, "kvram."):
        if info.name == "kvram.__main__":  # the command line's entry: it runs the command
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type) and issubclass(value, KerasSaveable)
                and value.__module__.startswith("kvram.")
            ):
                found.add(value)
    return found


def _kvram_functions() -> dict:
    """{registered name: function} of the functions kvram registers with Keras (activations)."""
    return {
        name: value for name, value in keras.saving.get_custom_objects().items()
        if name.startswith("kvram>") and not isinstance(value, type)
    }


def _dense_input():
    return keras.Input((6,)), np.random.default_rng(0).normal(size=(4, 6)).astype("float32")


def _sequence_input():
    return keras.Input((5, 8)), np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")


def _checkpoint():
    inputs, x = _dense_input()
    block = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)])
    return keras.Model(inputs, kvram.layers.Checkpoint(block)(inputs)), x


def _attention():
    inputs, x = _sequence_input()
    return keras.Model(inputs, kvram.layers.MemoryEfficientAttention(2, 4, chunk_size=2)(inputs, inputs)), x


def _fused_batch_norm():
    inputs, x = _dense_input()
    model = keras.Model(inputs, keras.layers.BatchNormalization()(keras.layers.Dense(6)(inputs)))
    assert kvram.speed.fuse_batch_norm(model) == 1
    return model, x


def _lean():
    inputs, x = _sequence_input()
    hidden = keras.layers.Dense(8, activation="gelu")(keras.layers.LayerNormalization()(inputs))
    model = keras.Model(inputs, hidden)
    assert kvram.speed.lean_activations(model) == 2  # the LayerNormalization and the GELU
    return model, x


def _lean_gelu_approximate():
    inputs, x = _dense_input()
    return keras.Model(inputs, keras.layers.Dense(4, activation=kvram.layers.lean.lean_gelu_approximate)(inputs)), x


def _lean_silu():
    inputs, x = _dense_input()
    return keras.Model(inputs, keras.layers.Dense(4, activation=kvram.layers.lean.lean_silu)(inputs)), x


def _functional_model():
    inputs, x = _dense_input()
    model = kvram.Model(inputs, keras.layers.Dense(3)(inputs), accumulation_steps=2, clip_global_norm=1.0)
    model.compile(optimizer="sgd", loss="mse")
    return model, x


def _pipeline():
    _, x = _dense_input()
    model = kvram.parallel.PipelineModel(
        [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)], ["CPU:0", "CPU:0"], micro_batches=2)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((4, 3), "float32"), batch_size=4, verbose=0)
    return model, x


def _adamw8bit():
    inputs, x = _dense_input()
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=kvram.optimizers.AdamW8bit(min_8bit_size=0), loss="mse")
    model.fit(x, np.zeros((len(x), 3), "float32"), verbose=0)  # its state built and saved
    return model, x


def _host_offload():
    inputs, x = _dense_input()
    model = kvram.Model(inputs, keras.layers.Dense(3)(inputs), host_offload=True)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, np.zeros((len(x), 3), "float32"), verbose=0)  # masters and state built and saved
    return model, x


def _sharded_state():
    inputs, x = _dense_input()
    model = kvram.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=kvram.optimizers.ShardedState(keras.optimizers.AdamW()), loss="mse")
    model.fit(x, np.zeros((len(x), 3), "float32"), verbose=0)  # one device: its shard is the whole
    return model, x


# How to build a model holding each kvram class (`kvram.Model` itself: its functional form).
BUILDERS = {
    "Checkpoint": _checkpoint,
    "MemoryEfficientAttention": _attention,
    "FusedBatchNormalization": _fused_batch_norm,
    "LeanLayerNormalization": _lean,
    "Model": _functional_model,
    "FunctionalModel": _functional_model,
    "PipelineModel": _pipeline,
    "AdamW8bit": _adamw8bit,
    "HostOffload": _host_offload,
    "ShardedState": _sharded_state,
}
# How to build a model using each kvram function (`lean_gelu` by `lean_activations`).
FUNCTION_BUILDERS = {"kvram>lean_gelu": _lean, "kvram>lean_gelu_approximate": _lean_gelu_approximate,
                     "kvram>lean_silu": _lean_silu}

_LOAD = """
import json, sys
import keras, numpy as np
import kvram

cases = json.load(open(sys.argv[1]))
for name, (path, data) in cases.items():
    model = keras.saving.load_model(path)
    saved = np.load(data)
    np.testing.assert_allclose(model.predict(saved["x"], verbose=0), saved["y"], rtol=1e-6, atol=1e-6,
                               err_msg=name)
    print(name, type(model).__name__, type(getattr(model, "optimizer", None)).__name__,
          sorted({type(layer).__name__ for layer in model._flatten_layers()}))
"""


def test_every_saveable_kvram_class_has_a_builder():
    classes = {cls.__name__ for cls in _kvram_classes()}
    assert {"Checkpoint", "LeanLayerNormalization", "PipelineModel"} <= classes  # the walk finds them
    assert classes - set(BUILDERS) == set(), "a kvram class with no builder in tests/test_saving.py"
    functions = set(_kvram_functions())
    assert functions - set(FUNCTION_BUILDERS) == set(), "a kvram function with no builder here"


@pytest.mark.parametrize("cls", sorted(_kvram_classes(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_saveable_kvram_class_is_registered(cls):
    name = keras.saving.get_registered_name(cls)
    assert name == f"kvram>{cls.__name__}" and keras.saving.get_registered_object(name) is cls


@pytest.mark.slow
def test_every_kvram_class_and_function_loads_in_a_process_that_imports_only_kvram(tmp_path):
    cases = {}
    builders = {**{cls.__name__: BUILDERS[cls.__name__] for cls in _kvram_classes()},
                **{name: FUNCTION_BUILDERS[name] for name in _kvram_functions()}}
    for name, build in builders.items():
        keras.backend.clear_session()
        model, x = build()
        kinds = {type(layer).__name__ for layer in model._flatten_layers()}
        activations = {keras.saving.get_registered_name(getattr(layer, "activation", None))
                       for layer in model._flatten_layers() if callable(getattr(layer, "activation", None))}
        kinds |= {n.removeprefix("kvram>") for n in activations} | {type(getattr(model, "optimizer", None)).__name__}
        assert name.removeprefix("kvram>") in kinds | {"Model"}
        stem = name.replace(">", "_")
        path, data = str(tmp_path / f"{stem}.keras"), str(tmp_path / f"{stem}.npz")
        model.save(path)
        np.savez(data, x=x, y=model.predict(x, verbose=0))
        cases[name] = (path, data)
    listing = tmp_path / "cases.json"
    listing.write_text(json.dumps(cases))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", _LOAD, str(listing)], capture_output=True, text=True,
                            cwd=str(tmp_path), env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert set(loaded) == set(cases)
    assert loaded["LeanLayerNormalization"].startswith("Functional") and "LeanLayerNormalization" in loaded[
        "LeanLayerNormalization"]
    assert loaded["PipelineModel"].startswith("PipelineModel")
    assert loaded["FunctionalModel"].startswith("FunctionalModel")
    assert loaded["AdamW8bit"].split()[1] == "AdamW8bit"
    assert loaded["HostOffload"].split()[1] == "HostOffload"
    assert loaded["ShardedState"].split()[1] == "ShardedState"


def test_a_registered_subclass_of_kvram_model_built_functionally_loads_as_itself(tmp_path):
    @keras.saving.register_keras_serializable(package="kvram_tests")
    class Net(kvram.Model):
        pass

    inputs, x = _dense_input()
    model = Net(inputs, keras.layers.Dense(2)(inputs), accumulation_steps=3)
    model.save(tmp_path / "net.keras")
    loaded = keras.saving.load_model(tmp_path / "net.keras")
    assert isinstance(loaded, Net) and loaded.accumulation_steps == 3
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
