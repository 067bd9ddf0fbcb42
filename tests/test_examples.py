import importlib.util
import os

import pytest

from tests.helpers import in_own_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.slow  # every test here: see ARCHITECTURE.md, tests


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 11.5 s on 2 cores
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_digits_shards_example_learns(tmp_path, request):
    pytest.importorskip("sklearn")
    if in_own_process(request):
        return
    accuracy = load("digits_shards").main(["--out", str(tmp_path / "digits"), "--epochs", "40"])
    assert accuracy > 0.8  # ten classes: chance is 0.1


@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_checkpointing_example_saves_memory_and_matches_loss(request):
    if in_own_process(request):  # the allocator's peak while training, in a process of its own
        return
    results = load("checkpointing").main([])
    (plain_peak, plain_loss), (ckpt_peak, ckpt_loss) = results[False], results[True]
    assert ckpt_peak < 0.5 * plain_peak
    assert abs(ckpt_loss - plain_loss) <= 1e-5 * abs(plain_loss)


def test_attention_example_matches_at_a_fraction_of_memory():
    plain, efficient, difference = load("attention").main(["--length", "2048"])
    assert efficient <= 0.25 * plain and difference < 1e-4


def test_adaptive_batching_example_recovers(tmp_path):
    losses, controller = load("adaptive_batching").main(["--logdir", str(tmp_path / "logs")])
    assert controller.oom_count == 3 and losses[-1] < losses[0]
    assert (tmp_path / "logs" / "memory.png").is_file()


def test_two_device_split_example_trains():
    losses = load("two_device_split").main([])
    assert losses[-1] < losses[0]


@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
@pytest.mark.longest
def test_mixed_precision_example_learns_in_every_policy(request):
    if in_own_process(request):
        return
    # 16x16 images (16 patches) and 2 blocks (the example's defaults: 32x32, 4 blocks): its main()
    # took 21.6 s alone on 2 cores, 40.0 s at 4 blocks (mostly tracing, per block and policy)
    results = load("mixed_precision").main(["--size", "16", "--depth", "2"])
    for policy, r in results.items():
        assert r["accuracy"] > 0.9, (policy, r)
    assert results["mixed_bfloat16"]["peak_mib"] < 0.9 * results["float32"]["peak_mib"]
    assert results["mixed_float16"]["peak_mib"] < 0.9 * results["float32"]["peak_mib"]
    assert results["mixed_float16"]["loss_scale"] and results["mixed_bfloat16"]["loss_scale"] is None


# Beside the suite, not alone: on the CPU both plan and train on the graph executor, not XLA (whose
# CPU checks choose otherwise under load): with two busy-looping processes beside them they passed
# three runs of three (2026-12-05), one printed at 0.97x (MobileNet) and 0.79x (GPT-2) of their
# budgets, where without load they trained at 0.97x and 0.73x
@pytest.mark.own_process
@pytest.mark.parametrize("example", [pytest.param("fit_a_budget", marks=pytest.mark.longest), "transformer_budget"])
def test_budget_example_trains_within_its_budget(example, request):
    if in_own_process(request):  # the allocator's peak while training, in a process of its own
        return
    # smaller than the examples' defaults (MobileNetV3Small at 64x64, a 4-layer GPT-2 over 256
    # tokens: 97 s and 70 s on 2 cores): the same planning and training in 55 s and 29 s
    smaller = {"fit_a_budget": ["--model", "MobileNet", "--size", "32"],
               "transformer_budget": ["--layers", "2", "--sequence", "128"]}[example]
    chosen, budget, peak = load(example).main(["--steps", "2", *smaller])
    assert chosen.runs and chosen.predicted_peak_bytes <= budget
    assert peak <= 1.10 * budget, (peak, budget)
