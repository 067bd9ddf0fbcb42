"""Flags kvram adds to XLA_FLAGS. XLA reads the variable once, at the first
compilation in the process, so each edit comes before any: `import kvram`
calls `add_fast` before it imports TensorFlow itself, and `kvram plan` starts
its checking child with `_plan_process.checking_environment`'s flags."""

from __future__ import annotations

import os

from kvram._env import switched_off

# `import kvram` adds FAST to XLA_FLAGS unless this is "0".
ENV = "KVRAM_XLA_FLAGS"

# What `import kvram` adds, each unless XLA_FLAGS names it. Measured on one H200:
# - cuBLASLt GEMMs: ViT-B/16 batch 256 +4.6% with MemoryEfficientAttention and
#   +3.5% with Keras's; ResNet50 +0.6% (benchmarks/results/vit_cublaslt_h200.json,
#   resnet50_cublaslt_h200.json, 2026-11-26).
# - XLA keeps a bf16/fp16 value rounded where the graph rounds it, instead of
#   carrying it in float32 between fusions (where it then writes the float32 copy:
#   ViT-B's GELU gradient, f32[256,197,3072]): ViT-B 3446 against 3310 img/s
#   (benchmarks/results/vit_tensordot_*excess_h200.json at commit 1fb3fe3); ResNet50 6429 against 6430
#   (benchmarks/results/resnet50_excess_h200.json, 2026-11-29). It is the rounding TensorFlow
#   without XLA does.
# The first is a GPU option; the second applies to the CPU's XLA too. Both apply
# to every XLA compilation in the process.
FAST = ("--xla_gpu_enable_cublaslt=true", "--xla_allow_excess_precision=false")


def add_unnamed(flags, environ: dict) -> list[str]:
    """Appends to environ["XLA_FLAGS"] each of `flags` whose name (before any
    "=") it does not set yet; returns those appended."""
    present = environ.get("XLA_FLAGS", "")
    named = {token.split("=")[0] for token in present.split()}
    added = [flag for flag in flags if flag.split("=")[0] not in named]
    if added:
        environ["XLA_FLAGS"] = " ".join([present, *added]).strip()
    return added


def add_fast(environ=None) -> list[str]:
    """`FAST`'s flags added to XLA_FLAGS where it does not name them, unless
    KVRAM_XLA_FLAGS is "0"; returns those added."""
    if switched_off(ENV, environ):
        return []
    return add_unnamed(FAST, os.environ if environ is None else environ)
