"""kvram: train TensorFlow/Keras models that would not otherwise fit in GPU memory.

The subpackages, from the top down (a lower one never imports a higher one):
`cli` (the `kvram` command) -> `remat` (checkpointing and planning),
`callbacks`, `parallel` -> `training` (`kvram.Model` and its step) ->
`layers`, `data`, `precision`, `memory`. ARCHITECTURE.md says more.
"""

import os as _os
import sys as _sys

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")
_keras = _sys.modules.get("keras")
_backend = _keras.backend.backend() if _keras is not None else _os.environ["KERAS_BACKEND"]
if _backend != "tensorflow":
    raise ImportError(
        f"kvram needs Keras's TensorFlow backend, and Keras's backend here is {_backend!r} "
        f"(KERAS_BACKEND={_os.environ['KERAS_BACKEND']!r}). Set KERAS_BACKEND=tensorflow, or leave it unset, "
        "before Keras is first imported."
    )
# TensorFlow keeps allocator statistics for the CPU (kvram.memory on "CPU:0": the
# demo, planning and tests on a machine without a GPU) only with its oneDNN CPU
# allocator, which it turns on by default only on CPUs with AVX-512 VNNI/AMX. It
# reads this once, when it is first imported.
if "tensorflow" not in _sys.modules:
    _os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

from kvram import _env, _plan_process, _quiet, _xla_flags  # noqa: E402

# cuBLASLt GEMMs and bf16/fp16 rounded where the graph says, before XLA's first
# compilation reads XLA_FLAGS (kvram/_xla_flags.py; KVRAM_XLA_FLAGS=0 leaves it)
_xla_flags.add_fast()

if _plan_process.wanted():  # `kvram plan`'s process that waits on its child: no TensorFlow
    _sys.exit(_plan_process.main())

_quiet.import_tensorflow_quietly()  # the `kvram` command only; see kvram/_quiet.py

from kvram import _custom_gradient  # noqa: E402

_custom_gradient.install()  # tracing linear in depth: kvram/_custom_gradient.py

from kvram import callbacks, data, layers, memory, optimizers, parallel, precision, remat, speed  # noqa: E402
from kvram._version import __version__  # noqa: E402
from kvram.training import Model  # noqa: E402

if speed.pins_by_default():  # batches reach the GPU by DMA; KVRAM_PIN_HOST_MEMORY=0 leaves it
    speed.pin_host_memory()
if not _env.switched_off(speed.TENSORDOT_ENV):  # weight gradients as one GEMM each
    speed.tensordot_einsum()

__all__ = [
    "Model",
    "callbacks",
    "data",
    "parallel",
    "layers",
    "memory",
    "optimizers",
    "precision",
    "remat",
    "speed",
    "__version__",
]
