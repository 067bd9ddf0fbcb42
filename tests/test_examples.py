import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_shards_example_learns(tmp_path):
    pytest.importorskip("sklearn")
    accuracy = load("digits_shards").main(["--out", str(tmp_path / "digits"), "--epochs", "40"])
    assert accuracy > 0.8  # ten classes: chance is 0.1
