"""The XLA flags `import kvram` adds (kvram/_xla_flags.py): each unless XLA_FLAGS
names it, none with KVRAM_XLA_FLAGS=0, and XLA accepts them."""

import os
import subprocess
import sys

import pytest

from kvram import _xla_flags


def test_flags_are_added_where_xla_flags_does_not_name_them():
    environ = {"XLA_FLAGS": "--xla_allow_excess_precision=true --xla_dump_to=/tmp/d"}
    assert _xla_flags.add_fast(environ) == ["--xla_gpu_enable_cublaslt=true"]
    assert environ["XLA_FLAGS"] == (
        "--xla_allow_excess_precision=true --xla_dump_to=/tmp/d --xla_gpu_enable_cublaslt=true"
    )
    assert _xla_flags.add_fast(environ) == []  # a second call adds nothing


def test_all_are_added_to_an_unset_xla_flags():
    environ = {}
    assert _xla_flags.add_fast(environ) == list(_xla_flags.FAST)
    assert environ["XLA_FLAGS"] == "--xla_gpu_enable_cublaslt=true --xla_allow_excess_precision=false"


def test_the_environment_variable_leaves_xla_flags():
    environ = {_xla_flags.ENV: " 0 ", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert _xla_flags.add_fast(environ) == []
    assert environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    assert _xla_flags.add_fast({_xla_flags.ENV: "0"}) == []


@pytest.mark.slow  # a child process
def test_import_kvram_adds_them_and_xla_compiles_with_them():
    # XLA stops the process at its first compilation if XLA_FLAGS names a flag it does not know
    code = ("import os, kvram, tensorflow as tf\n"
            "f = tf.function(lambda x: tf.nn.gelu(x * 2), jit_compile=True)\n"
            "print(float(f(tf.constant([1.0], tf.bfloat16))[0]))\n"
            "print(os.environ['XLA_FLAGS'])")
    named = "--xla_allow_excess_precision=true"
    for value, flags, expected in (("1", None, " ".join(_xla_flags.FAST)),
                                   ("1", named, named + " --xla_gpu_enable_cublaslt=true"),
                                   ("0", named, named)):
        env = {key: v for key, v in os.environ.items() if key != "XLA_FLAGS"}
        env.update({_xla_flags.ENV: value, "TF_CPP_MIN_LOG_LEVEL": "3", **({"XLA_FLAGS": flags} if flags else {})})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        value_line, flags_line = out.stdout.strip().splitlines()[-2:]
        assert abs(float(value_line) - 1.953125) < 1e-6  # gelu(2) = 1.9545, in bf16
        assert flags_line == expected
