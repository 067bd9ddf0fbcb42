"""Mixed precision in one call: the Keras dtype policy, TF32, and the loss scale."""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

__all__ = ["enable", "current_policy", "auto_policy", "loss_scale", "check_model_policy"]

POLICIES = ("mixed_float16", "mixed_bfloat16", "float32", "auto")


def auto_policy(devices=None) -> str:
    """The policy `enable("auto")` picks for the visible GPUs.

    Rule: bfloat16 where the GPU's tensor cores run it (compute capability >= 8.0:
    A100, A6000, H100, ...): same speed as float16 there, with float32's exponent
    range, so no loss scaling and no skipped steps. float16 with loss scaling on
    Volta/Turing (7.x), whose tensor cores have no bfloat16. float32 on older GPUs
    and on the CPU, where reduced precision brings no speed. The GPU benchmark in
    `benchmarks/resnet50/` measures float16 against bfloat16 on the same GPU.

    Args:
        devices: physical GPU devices to look at; default: all visible GPUs.

    Returns:
        "mixed_bfloat16", "mixed_float16" or "float32".
    """
    gpus = tf.config.list_physical_devices("GPU") if devices is None else list(devices)
    if not gpus:
        return "float32"
    capabilities = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        capabilities.append(details.get("compute_capability", (0, 0)))
    lowest = min(capabilities)
    if lowest >= (8, 0):
        return "mixed_bfloat16"
    if lowest >= (7, 0):
        return "mixed_float16"
    return "float32"


def enable(policy: str = "auto", tf32: bool | None = None) -> str:
    """Sets the Keras global dtype policy (and optionally TF32) for models built next.

    Call it **before** building the model: a layer takes the global policy when it is
    created, so a model built earlier keeps its old policy (`kvram.Model.compile()`
    warns when it sees that). Under "mixed_float16", `compile()` wraps the optimizer
    in Keras's `LossScaleOptimizer`; `loss_scale(model)` reads the current scale.

    Args:
        policy: "mixed_float16", "mixed_bfloat16", "float32" or "auto" (see
            `auto_policy`).
        tf32: True/False to enable or disable TensorFloat-32 for float32 matrix
            products and convolutions on Ampere and newer GPUs (faster, ~1e-3
            relative precision); None leaves TensorFlow's setting (on by default).

    Returns:
        The policy name now in force.

    Raises:
        ValueError: for an unknown policy. TypeError: for a non-bool `tf32`.
    """
    if policy not in POLICIES:
        raise ValueError(
            f"Unknown precision policy. Allowed: {', '.join(map(repr, POLICIES))}. "
            f"Received: policy={policy!r}"
        )
    if tf32 is not None and not isinstance(tf32, bool):
        raise TypeError(f"`tf32` must be True, False or None. Received: tf32={tf32!r}")
    name = auto_policy() if policy == "auto" else policy
    keras.config.set_dtype_policy(name)
    if tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    return name


def current_policy() -> str:
    """The name of the Keras global dtype policy in force."""
    return keras.config.dtype_policy().name


def loss_scale(model_or_optimizer) -> float | None:
    """The current dynamic loss scale, or None when no loss scaling is active.

    Args:
        model_or_optimizer: a compiled Keras model or an optimizer.
    """
    optimizer = getattr(model_or_optimizer, "optimizer", model_or_optimizer)
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    if not optimizer.built:
        return float(optimizer.initial_scale)
    return float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))


def check_model_policy(model) -> None:
    """Warns when `model` was built under another policy than the one now in force."""
    built = getattr(model, "_built_under_policy", None) or model.dtype_policy.name
    now = current_policy()
    if built != now:
        warnings.warn(
            f"Model {model.name!r} was built under the dtype policy {built!r} but the "
            f"policy now in force is {now!r}: the model keeps {built!r}. Call "
            "kvram.precision.enable(...) before building the model.",
            stacklevel=3,
        )
