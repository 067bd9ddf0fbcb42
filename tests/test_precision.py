import keras
import pytest
import tensorflow as tf

import kvram


def test_enable_sets_global_policy():
    assert kvram.precision.enable("mixed_bfloat16") == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert kvram.precision.current_policy() == "mixed_bfloat16"


def test_auto_is_float32_without_gpu():
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible")
    assert kvram.precision.enable("auto") == "float32"


def test_auto_rule_by_compute_capability(monkeypatch):
    caps = {}
    monkeypatch.setattr(
        tf.config.experimental, "get_device_details", lambda d: {"compute_capability": caps[d]}
    )
    for cap, expected in [((9, 0), "mixed_bfloat16"), ((8, 6), "mixed_bfloat16"),
                          ((7, 5), "mixed_float16"), ((6, 1), "float32")]:
        caps["gpu"] = cap
        assert kvram.precision.auto_policy(["gpu"]) == expected


def test_unknown_policy():
    with pytest.raises(ValueError, match=r"Unknown precision policy. Allowed: 'mixed_float16'.*Received: policy='fp16'"):
        kvram.precision.enable("fp16")


def test_bad_tf32():
    with pytest.raises(TypeError, match=r"Received: tf32='yes'"):
        kvram.precision.enable("float32", tf32="yes")


def test_tf32_switch():
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        kvram.precision.enable("float32", tf32=False)
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


def test_warns_when_model_built_under_other_policy():
    inputs = keras.Input((4,))
    model = kvram.Model(inputs, keras.layers.Dense(2)(inputs))
    kvram.precision.enable("mixed_float16")
    with pytest.warns(UserWarning, match=r"built under the dtype policy 'float32'.*now in force is 'mixed_float16'"):
        model.compile(optimizer="sgd", loss="mse")


def test_loss_scale_none_without_scaling():
    inputs = keras.Input((4,))
    model = kvram.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    assert kvram.precision.loss_scale(model) is None
