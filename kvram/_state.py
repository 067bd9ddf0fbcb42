"""The variables a layer's call may write, as distinct from the weights it only reads."""

from __future__ import annotations


def mutable_state(layer) -> list:
    """The variables `layer` (and the layers within it) may assign while it runs
    in training: those a layer made non-trainable for itself (BatchNormalization's
    moving statistics) and its seed generators' states.

    Not state: weights frozen by `layer.trainable = False` (Keras then marks
    them non-trainable too, which is why `non_trainable_variables` cannot tell
    them apart: a LoRA-wrapped backbone's frozen kernels are all there) and the
    variables of quantized layers (Keras's int8/int4 kernels and scales are
    non-trainable and only read; float8's scales and histories are trainable
    variables the optimizer overwrites). Copying those for a recomputation,
    or putting them back after a measured step, would only cost memory and time.
    """
    found, seen = [], set()
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        own = [] if getattr(sub, "quantization_mode", None) else sub._non_trainable_variables
        for variable in list(own) + [g.state for g in getattr(sub, "_seed_generators", [])]:
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found
