"""kvram.remat.estimate and `kvram plan`: will a model fit, and how."""

import functools
import json
import os
import re
import sys

import keras
import numpy as np
import pytest

import kvram
from kvram import _plan_process, cli, remat
from tests.helpers import in_own_process, residual_model


def small_model():
    """Residual conv blocks at 32x32 (a `module:function` for `kvram plan --model`)."""
    return residual_model()


@pytest.mark.parametrize(
    "text, expected",
    [("48GB", 48 * 10**9), ("16GiB", 16 * 2**30), ("1024", 1024), ("1.5 MiB", 3 * 2**19), ("80gb", 80 * 10**9)],
)
def test_parse_bytes(text, expected):
    assert remat.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "-5GB", "0", "12XB", ""])
def test_parse_bytes_says_what_is_allowed(text):
    with pytest.raises(ValueError, match=r"positive number with an optional unit .* Received"):
        remat.parse_bytes(text)


@functools.lru_cache(maxsize=None)
def _direct(batch):
    """The batch's plan measured directly, and the memory midway between its
    plain and least peaks: made once per batch and shared by the tests that
    read it (one plan of the small model at 64 rows took 12-14 s on 2 cores)."""
    direct = remat.plan(
        small_model(),
        (np.random.default_rng(0).random((batch, 32, 32, 3)).astype("float32"), np.arange(batch) % 10),
        optimizer="adam",
    )
    return direct, (direct.plain_peak_bytes + direct.minimum_peak_bytes) // 2


@pytest.mark.slow
def test_estimate_extrapolates_and_recommends_what_fits():
    batch = 64
    # the memory the full batch would need unmodified, measured directly
    direct, memory = _direct(batch)
    found = remat.estimate(small_model, batch, memory_bytes=memory, precisions=("float32",), margin=0.0)
    rows = {(c.micro_batch_size, c.remat): c for c in found.configurations}
    assert set(rows) == {(None, "none"), (None, "fit"), (None, "least"), (32, "none"), (32, "least"),
                         (16, "none"), (16, "least")}, rows
    plain = rows[(None, "none")]
    # measured at batches of 8 and 16, extrapolated to 64
    assert abs(plain.predicted_peak_bytes - direct.plain_peak_bytes) <= 0.15 * direct.plain_peak_bytes
    assert not plain.fits and rows[(None, "fit")].fits and rows[(None, "least")].fits
    assert rows[(None, "fit")].relative_step_time <= rows[(None, "least")].relative_step_time
    # each slice beyond the first adds micro_batch_overhead (0.05) of a step
    assert rows[(32, "none")].relative_step_time == pytest.approx(1.05)
    assert rows[(16, "none")].relative_step_time == pytest.approx(1.15)
    # (each slice size has its own least-memory choice, and recomputed fraction)
    least = rows[(16, "least")]
    assert least.relative_step_time == pytest.approx(1 + least.plan.recompute_fraction + 0.15)
    # the fastest predicted that fits: two slices (1.05) before the whole
    # batch recomputing (1 + its recomputed FLOPs, above 5% here)
    assert rows[(None, "fit")].relative_step_time > 1.05
    assert found.recommended is rows[(32, "none")]
    # nothing predicted faster fits
    faster = [c for c in found.configurations if c.relative_step_time < found.recommended.relative_step_time]
    assert faster and not any(c.fits for c in faster), faster
    assert rows[(16, "none")].predicted_peak_bytes < rows[(32, "none")].predicted_peak_bytes < plain.predicted_peak_bytes
    text = str(found)
    assert "<- recommended" in text and "float32" in text, text
    # what stays beside the step, per precision: in the table and through the JSON report
    state = found.state["float32"]
    weights = sum(int(np.prod(v.shape)) * 4 for v in small_model().variables)
    assert state["weights"] == weights and 0 < state["gradients"] <= weights and state["optimizer"] >= 2 * state["gradients"]
    assert "float32: weights" in text and "optimizer state" in text, text
    assert remat.Estimate.from_json(json.loads(json.dumps(found.to_json()))).state == found.state


@pytest.mark.slow
def test_a_dearer_slice_recommends_the_whole_batch_recomputing():
    batch = 64
    _, memory = _direct(batch)
    found = remat.estimate(small_model, batch, memory_bytes=memory, precisions=("float32",), margin=0.0,
                          micro_batch_sizes=[32], micro_batch_overhead=0.5)
    rows = {(c.micro_batch_size, c.remat): c for c in found.configurations}
    assert rows[(32, "none")].relative_step_time == pytest.approx(1.5)
    assert found.recommended is rows[(None, "fit")] and found.recommended.relative_step_time < 1.5


@pytest.mark.parametrize("overhead", [-0.1, 1.0, 2])
def test_micro_batch_overhead_is_validated(overhead):
    with pytest.raises(ValueError, match=rf"micro_batch_overhead must be in \[0, 1\). Received: {overhead}"):
        remat.estimate(small_model, 16, memory_bytes=2**30, micro_batch_overhead=overhead)


@pytest.mark.slow
@pytest.mark.own_process  # the prediction and fit()'s peak in a process of its own (in a pytest-xdist
def test_estimate_measure_runs_the_recommendation_and_plain_keras(request):  # worker: 41.5 vs 35.9 MiB)
    if in_own_process(request):
        return
    found = remat.estimate(small_model, 32, memory_bytes=10 * 2**30, precisions=("float32",))
    result = remat.measure(small_model, found.recommended, 32, steps=2)
    assert result["steps"] == 2 and result["device"] == "CPU:0"
    assert result["peak_bytes"] > 0 and result["samples_per_second"] > 0
    assert result["plain"]["peak_bytes"] > 0 and result["plain"]["samples_per_second"] > 0
    # predicted within 15% of what training used
    assert abs(found.recommended.predicted_peak_bytes - result["peak_bytes"]) <= 0.15 * result["peak_bytes"]


def test_estimate_with_nothing_that_fits():
    found = remat.estimate(small_model, 32, memory_bytes=10**5, precisions=("float32",))
    assert found.recommended is None and not any(c.fits for c in found.configurations)
    assert "nothing fits" in str(found)
    # Adam's moments: the table says what 8-bit ones would take, and that it still does not fit
    state = found.state["float32"]
    # (most of this small model's variables are under AdamW8bit's 4096 values: float32 moments)
    assert 0 < state["optimizer_8bit"] <= state["optimizer"], state
    assert "float32 with 8-bit moments (--optimizer adamw8bit" in str(found) and "still does not fit" in str(found)
    # host_offload: the state leaves the device, and the host's update time is measured here
    assert state["masters"] == 4 * sum(int(np.prod(v.shape)) for v in small_model().trainable_variables)
    assert state["host_update_parameters_per_s"] > 0
    assert "with kvram.Model(host_offload=True)" in str(found) and " per update beside the copies" in str(found)
    # and what HostOffload would need of this host, beside what it has free
    from kvram.optimizers import HostOffload

    need, _ = HostOffload(keras.optimizers.Adam()).required_host_bytes(small_model().trainable_variables)
    assert state["host_need"] == need > state["masters"] and state["host_available"] > 0
    assert state["host_need_groups"] == need  # Keras's Adam updates in place: no working copies either way
    assert f"the host needs {remat._checker._size(need)} for it" in str(found), str(found)
    # the variables alone are over 100 kB: no step is checked, each row says so
    messages = [message for _, message in found.log]
    assert not any("checked" in m and "not checked" not in m for m in messages), messages
    assert sum("not checked, its variables, optimizer state and batch alone" in m for m in messages) == len(
        found.configurations), messages


@pytest.mark.slow
def test_estimate_measures_a_precision_only_when_none_before_it_fits(monkeypatch):
    import keras

    built = []

    def build():
        built.append(keras.config.dtype_policy().name)
        return small_model()

    kwargs = dict(memory_bytes=2**30, precisions=("float32", "mixed_bfloat16"), micro_batch_sizes=[])
    found = remat.estimate(build, 8, **kwargs)
    # float32's plain step fits: mixed_bfloat16 is neither built nor measured
    assert built == ["float32"]
    assert found.recommended.precision == "float32" and found.recommended.remat == "none"
    assert {c.precision for c in found.configurations} == {"float32"}
    assert found.not_estimated == ["mixed_bfloat16"]
    assert "not estimated: mixed_bfloat16" in str(found)
    from kvram.remat._plan import Plan

    def not_copied(plan, memo):
        raise AssertionError("the report deep-copied a plan (its model, profile and checks)")

    monkeypatch.setattr(Plan, "__deepcopy__", not_copied, raising=False)
    report = found.to_json()
    assert report["not_estimated"] == ["mixed_bfloat16"] and json.dumps(report)
    assert [r["remat"] for r in report["configurations"] if r["recommended"]] == ["none"]
    assert keras.config.dtype_policy().name == "float32"

    built.clear()
    every = remat.estimate(build, 8, every_precision=True, **kwargs)
    assert built == ["float32", "mixed_bfloat16"]
    assert {c.precision for c in every.configurations} == {"float32", "mixed_bfloat16"}
    assert every.not_estimated == [] and "not estimated" not in str(every)
    # the same recommendation: precisions are preferred in their order
    assert (every.recommended.precision, every.recommended.remat) == ("float32", "none")


@pytest.mark.slow
def test_estimate_checks_what_fits_beside_the_variables():
    # A memory the variables fit in but no step does: the rows are checked
    # (only rows whose resident bytes alone are over the limit are skipped).
    found = remat.estimate(small_model, 8, memory_bytes=600_000, precisions=("float32",), micro_batch_sizes=[],
                          margin=0.0)
    messages = [message for _, message in found.log]
    assert found.recommended is None and any(m.startswith("float32: checked") for m in messages), messages


@pytest.mark.slow
@pytest.mark.own_process
def test_cli_plan_keras_applications_model(request, capsys):
    if in_own_process(request):  # run ahead, beside the suite (tests/helpers.py)
        return
    # MobileNet (v1): the keras.applications model with the fewest layers (the `kvram plan`
    # command took 30 s where MobileNetV3Small took 47 s, side by side on 2 cores)
    code = cli.main([
        "plan", "--model", "keras.applications.MobileNet", "--input-shape", "32,32,3",
        "--classes", "10", "--batch-size", "16", "--gpu-memory", "1GB", "--precision", "float32",
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "<- recommended" in printed and printed.count("float32") >= 3, printed


@pytest.mark.parametrize("flag, every", [([], False), (["--every-precision"], True)])
def test_cli_plan_every_precision_reaches_the_estimate(flag, every, monkeypatch):
    seen = {}

    def estimate(build, batch_size, **kwargs):
        seen.update(kwargs, batch_size=batch_size)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(remat, "estimate", estimate)
    with pytest.raises(SystemExit, match="kvram plan: stopped by the test"):
        cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "16",
                  "--gpu-memory", "1GB", "--isolate", "never", *flag])
    assert seen["every_precision"] is every and seen["batch_size"] == 16
    assert seen["precisions"] == ("mixed_bfloat16", "mixed_float16", "float32")


@pytest.mark.slow
def test_cli_plan_measure(tmp_path, capsys, recwarn):
    # --measure trains with Keras's fit(), which compiles with XLA on the CPU too: the small
    # residual model here (MobileNetV3Small took 151 s beside the suite on 2 cores)
    out = tmp_path / "plan.json"
    code = cli.main([
        "plan", "--model", "tests.test_plan:small_model", "--batch-size", "16", "--gpu-memory", "1GB",
        "--precision", "float32", "--measure", "--steps", "2", "--json", str(out),
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "<- recommended" in printed and "measured, 2 steps on CPU:0" in printed, printed
    # the estimate printed once, before --measure trains (kept if training dies)
    assert printed.count("<- recommended") == 1
    assert printed.index("<- recommended") < printed.index("measured, 2 steps"), printed
    report = json.loads(out.read_text())
    assert sum(c["recommended"] for c in report["configurations"]) == 1
    assert report["measured"]["plain"]["peak_bytes"] > 0
    # no warning of Keras's about shuffling a dataset (a line in the command's output)
    assert not [w for w in recwarn if "shuffle" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.slow
def test_cli_plan_measure_leaves_out_plain_keras_estimated_out_of_memory(tmp_path, capsys, monkeypatch):
    # batch 64 under 32 MiB (28.8 planned): the whole batch without recomputation is
    # predicted at ~72 MiB, over twice that, and is not checked; 16-row slices fit
    trained = []
    measure = remat.measure

    def recording(*args, **kwargs):
        trained.append(kwargs)
        return measure(*args, **kwargs)

    monkeypatch.setattr(remat, "measure", recording)
    out = tmp_path / "plan.json"
    code = cli.main([
        "plan", "--model", "tests.test_plan:small_model", "--batch-size", "64", "--gpu-memory", "32MiB",
        "--precision", "float32", "--measure", "--steps", "2", "--isolate", "never", "--json", str(out),
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    plain = [c for c in report["configurations"] if c["micro_batch_size"] is None and c["remat"] == "none"]
    assert len(plain) == 1 and not plain[0]["fits"] and "over the limit" in plain[0]["not_checked"], plain
    assert [{k: v for k, v in t.items() if k != "log"} for t in trained] == [
        {"optimizer": "adam", "steps": 2, "plain": False}]
    assert all(callable(t["log"]) for t in trained)
    assert "plain Keras not run (out of memory as estimated: predicted" in printed, printed
    assert report["measured"]["plain"]["peak_bytes"] is None and report["measured"]["samples_per_second"] > 0


@pytest.mark.slow
def test_cli_plan_module_function_and_keras_file(tmp_path, capsys):
    assert cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "16",
                     "--gpu-memory", "1GB", "--precision", "float32"]) == 0
    assert "<- recommended" in capsys.readouterr().out
    path = tmp_path / "small.keras"
    small_model().save(path)
    assert cli.main(["plan", "--model", str(path), "--batch-size", "16", "--gpu-memory", "1GB"]) == 0
    printed = capsys.readouterr().out
    # a saved model keeps its own precision: one set of rows (3 slice sizes x none, least), and
    # one line of its state in that precision
    rows = [line for line in printed.splitlines() if re.match(r"\w+ +(-|\d+) +(none|least) ", line)]
    assert len(rows) == 6 and all(row.startswith("float32 ") for row in rows), printed
    assert [line.split(":")[0] for line in printed.splitlines() if ": weights " in line] == ["float32"], printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "ResNet50", "--input-shape", "32,32,3", "--gpu-memory", "lots"], "--gpu-memory: A memory size"),
        (["--model", "NoSuchNet", "--input-shape", "32,32,3"], "not a keras.applications model"),
        (["--model", "ResNet50"], "--input-shape is needed"),
        (["--model", "missing.keras"], "no such file"),
        (["--model", "no_such_module:f"], "cannot import it"),
        (["--model", "ResNet50", "--input-shape", "32,32,3", "--micro-batch-sizes", "4,half"],
         r"--micro-batch-sizes: '4,half'. Allowed: comma-separated row counts"),
        (["--model", "ResNet50", "--input-shape", "32,32,3", "--limit-gpu"], "--limit-gpu needs --gpu-memory"),
        (["--model", "ResNet50", "--input-shape", "224x224"],
         r"^kvram plan: --input-shape 224x224: expected positive integers separated by commas, H,W,C for an "
         r"image model \(e.g. 224,224,3\)$"),
        (["--model", "ResNet50", "--input-shape", "224,224", "--gpu-memory", "2GB"],
         r"^kvram plan: --model ResNet50: keras.applications.ResNet50 raised ValueError: `input_shape` must be "
         r"a tuple of three integers.$"),
    ],
)
def test_cli_plan_bad_input(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["plan", "--batch-size", "8", *argv])


def test_cli_plan_finds_a_module_beside_the_user_and_says_what_its_function_did(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    (tmp_path / "kvram_test_badmod.py").write_text(
        "def build():\n    raise RuntimeError('out of ideas')\n\ndef three():\n    return 3\n")
    with pytest.raises(SystemExit, match=r"^kvram plan: --model kvram_test_badmod:build: build\(\) raised "
                                         r"RuntimeError: out of ideas$"):
        cli.main(["plan", "--batch-size", "8", "--model", "kvram_test_badmod:build", "--isolate", "never",
                  "--gpu-memory", "1GB"])
    with pytest.raises(SystemExit, match=r"^kvram plan: --model kvram_test_badmod:three: three\(\) returned "
                                         r"int, not a Keras model$"):
        cli.main(["plan", "--batch-size", "8", "--model", "kvram_test_badmod:three", "--isolate", "never",
                  "--gpu-memory", "1GB"])
    (tmp_path / "notzip.keras").write_text("junk")
    with pytest.raises(SystemExit, match=r"^kvram plan: --model notzip.keras: not a .keras file \(model.save "
                                         r"writes a zip archive; this is 4 bytes of something else\)$"):
        cli.main(["plan", "--batch-size", "8", "--model", "notzip.keras"])


def test_cli_plan_limit_gpu_says_when_there_is_no_gpu():
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is present: --limit-gpu would limit it")
    with pytest.raises(SystemExit, match="--limit-gpu: TensorFlow sees no GPU"):
        cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "8",
                  "--gpu-memory", "1GB", "--limit-gpu", "--isolate", "never"])


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_estimate_checks_under_xla_and_training_confirms_it(request):
    # Beside the rest of the suite, as the next test is: with two busy-looping processes beside them
    # both passed six runs of six on 2 cores (2026-12-07)
    if in_own_process(request):  # fit()'s peak, measured in a process of its own
        return
    batch = 64
    x = np.random.default_rng(0).random((batch, 32, 32, 3)).astype("float32")
    direct = remat.plan(small_model(), (x, np.arange(batch) % 10), optimizer="adam", jit_compile=True)
    memory = (direct.plain_peak_bytes + direct.minimum_peak_bytes) // 2
    # Checked at the batch's own rows, as on a GPU that holds the memory
    # (check_at="auto"). Under XLA on the CPU few choices lower the step's
    # peak, and fewer at the probes' rows (at 8 rows one of 81:
    # benchmarks/results/xla_cpu_choices_8.json at commit 1fb3fe3), so a search at the probes
    # found one within this memory in some runs only (CI failed so, nothing
    # fitting); at 64 rows remat.plan's own search found the least peak above.
    # The search's logic is tested with faked checks below.
    found = remat.estimate(small_model, batch, memory_bytes=memory, precisions=("float32",),
                          micro_batch_sizes=[], margin=0.0, jit_compile=True, check_at="batch")
    print(found)
    rows = {c.remat: c for c in found.configurations}
    # checked in the order of preference until one fits: plain does not
    assert rows["none"].predicted_by == "xla" and not rows["none"].fits
    recommended = found.recommended
    said = "\n".join(f"[{t:7.1f} s] {m}" for t, m in found.log)  # what was checked, should this fail
    assert recommended is not None and recommended.predicted_by == "xla" and recommended.remat != "none", said
    assert "from: xla / graph = checked" in str(found)
    # the same runs checked by remat.plan at the same rows
    at_batch = direct.resident_bytes + direct.check(recommended.plan.runs)
    assert abs(recommended.predicted_peak_bytes - at_batch) <= 0.05 * at_batch, (
        recommended, recommended.plan.runs, at_batch)
    # Keras's fit() compiles with XLA (its jit_compile="auto", on the CPU too);
    # its step also applies the optimizer (not in the checked step)
    result = remat.measure(small_model, recommended, batch, steps=2, plain=False)
    print(f"predicted {recommended.predicted_peak_bytes:,}, fit() measured {result['peak_bytes']:,}")
    assert result["peak_bytes"] <= 1.10 * memory, (result, memory)


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_estimate_extrapolates_xla_checks_from_the_probes(request):
    # XLA-compiled steps at 8, 16 and 32 rows, extrapolated to 64: the plain
    # step's peak grows in proportion to the rows (8.0, 16.0, 32.0 MiB). In a
    # process of its own: in the suite's, the direct check at 64 rows once
    # read 70.7 MiB where it reads 64.9 alone (see in_own_process)
    if in_own_process(request):
        return
    batch = 64
    x = np.random.default_rng(0).random((batch, 32, 32, 3)).astype("float32")
    direct = remat.plan(small_model(), (x, np.arange(batch) % 10), budget_bytes=2**40, optimizer="adam",
                        jit_compile=True)
    found = remat.estimate(small_model, batch, memory_bytes=2 * direct.plain_peak_bytes, precisions=("float32",),
                          micro_batch_sizes=[], margin=0.0, jit_compile=True, check_at="probes", verbose=True)
    plain = found.recommended
    assert plain is not None and plain.remat == "none" and plain.predicted_by == "xla"
    assert abs(plain.predicted_peak_bytes - direct.plain_peak_bytes) <= 0.15 * direct.plain_peak_bytes, (
        plain, direct.plain_peak_bytes)
    checked = [message for _, message in found.log if "checked" in message]
    assert [m.split(": step peak")[0] for m in checked] == [
        f"float32: checked (xla) at {rows} rows with 0 recomputed run(s)" for rows in (8, 16, 32)], checked


@pytest.mark.slow
def test_estimate_checks_each_configuration_at_its_own_rows():
    batch = 64
    direct, memory = _direct(batch)
    found = remat.estimate(small_model, batch, memory_bytes=memory, precisions=("float32",),
                          micro_batch_sizes=[32], margin=0.0, check_at="batch", verbose=True,
                          micro_batch_overhead=0.5)  # slices dearer than recomputing: the whole batch fits
    assert found.check_at == "batch" and "at its own rows" in str(found)
    rows = {(c.micro_batch_size, c.remat): c for c in found.configurations}
    # checked in the order of preference until one fits: plain does not, at the batch itself
    assert rows[(None, "none")].predicted_by == "graph" and not rows[(None, "none")].fits
    recommended = found.recommended
    assert recommended.micro_batch_size is None and recommended.remat == "fit"
    assert recommended.fits and recommended.predicted_by == "graph"
    # the same runs, checked by remat.plan at the same batch (graph executor: highest of three runs)
    at_batch = direct.resident_bytes + direct.check(recommended.plan.runs)
    assert abs(recommended.predicted_peak_bytes - at_batch) <= 0.05 * at_batch, (recommended, at_batch)
    # each stage logged with its time; no check at the probe batches
    messages = [message for _, message in found.log]
    assert any("checked (graph) at 64 rows with 0 recomputed run(s)" in m for m in messages), messages
    assert not any("at 8 rows" in m or "at 16 rows" in m for m in messages if "checked" in m), messages
    report = found.to_json()
    assert report["log"] and report["check_at"] == "batch"
    # the runs' segment indices, named: each segment's last layer
    assert report["segments"]["float32"] == [s.layers[-1] for s in remat.segments(small_model())]


@pytest.mark.slow
def test_a_checks_file_keeps_each_check_and_the_next_estimate_reuses_them(tmp_path, monkeypatch):
    path = tmp_path / "checks.json"
    kwargs = dict(memory_bytes=2**30, precisions=("float32",), micro_batch_sizes=[], margin=0.0,
                  checks_file=str(path))
    first = remat.estimate(small_model, 16, **kwargs)
    # plain fits: checked at the probes' 2 and 4 rows and at 8, each kept as made
    kept = json.loads(path.read_text())["checks"]
    assert sorted(json.loads(key)[-2] for key in kept) == [2, 4, 8], kept
    assert all(isinstance(v, int) for v in kept.values()) and max(kept.values()) > 0, kept
    assert not (tmp_path / "checks.json.partial").exists()

    def no_step(*args):
        raise AssertionError("a kept check was run again")

    monkeypatch.setattr(remat._check, "_step_peak_or_raise", no_step)
    second = remat.estimate(small_model, 16, **kwargs)
    assert [c.predicted_peak_bytes for c in second.configurations if c.predicted_by == "graph"] == [
        c.predicted_peak_bytes for c in first.configurations if c.predicted_by == "graph"]
    messages = [message for _, message in second.log]
    assert f"3 check(s) read from {path}" in messages, messages
    assert sum("(from the checks file)" in m for m in messages) == 3, messages


def test_a_checks_file_keeps_a_check_out_of_memory_as_such(tmp_path):
    path = str(tmp_path / "checks.json")
    store = _plan_process.CheckStore(path, lambda message: None)
    store.put("a", remat._check._OutOfMemory(1234))
    store.put("b", 5678)
    again = _plan_process.CheckStore(path, lambda message: None)
    assert isinstance(again.get("a"), remat._check._OutOfMemory) and int(again.get("a")) == 1234
    assert again.get("b") == 5678 and not isinstance(again.get("b"), remat._check._OutOfMemory)
    assert again.get("c") is None


def test_a_file_that_is_not_a_checks_file_is_refused(tmp_path):
    path = tmp_path / "checks.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"checks_file .* is not a checks file kvram wrote .* Allowed"):
        remat.estimate(small_model, 16, memory_bytes=2**30, checks_file=str(path))


def _plan_in_child(tmp_path, monkeypatch, abort_at, once):
    monkeypatch.setenv("KVRAM_TEST_ABORT_AT", str(abort_at))
    if once:
        monkeypatch.setenv("KVRAM_TEST_ABORT_MARKER", str(tmp_path / "aborted"))
    return cli.main([
        "plan", "--model", "tests.helpers:aborting_model", "--batch-size", "16", "--gpu-memory", "1GB",
        "--precision", "float32", "--micro-batch-sizes", "none", "--isolate", "always",
        "--checks-file", str(tmp_path / "checks.json"), "--json", str(tmp_path / "plan.json"),
    ])


@pytest.mark.slow
def test_cli_plan_starts_its_process_again_from_the_kept_checks_after_an_abort(tmp_path, monkeypatch, capfd):
    # the child aborts at its second check (the first is kept); the second
    # child reads it, makes the others and prints the estimate
    code = _plan_in_child(tmp_path, monkeypatch, abort_at=2, once=True)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert (tmp_path / "aborted").exists()
    assert "the estimate's process was killed by SIGABRT after 1 new check(s)" in err, err[-3000:]
    assert "starting it again from the 1 check(s) kept in" in err
    assert "1 check(s) read from" in err and "(from the checks file)" in err, err[-3000:]
    # the check it died in is tried again, in the next process
    assert "in the check after them (tried again" in err and "the process died in it 1 time(s) before" in err
    assert "<- recommended" in out
    report = json.loads((tmp_path / "plan.json").read_text())
    assert [c["remat"] for c in report["configurations"] if c["recommended"]] == ["none"]
    kept = json.loads((tmp_path / "checks.json").read_text())
    assert len(kept["checks"]) == 3 and kept["started"] == {} and kept["begun"] == 4


@pytest.mark.slow
def test_cli_plan_stops_when_its_process_aborts_before_a_new_check(tmp_path, monkeypatch, capfd):
    code = _plan_in_child(tmp_path, monkeypatch, abort_at="build", once=False)
    _, err = capfd.readouterr()
    assert code == 1
    assert "was killed by SIGABRT with no new check since it started; stopped. Its 0 check(s)" in err, err[-3000:]
    assert f"--checks-file {tmp_path / 'checks.json'}" in err
    assert not (tmp_path / "plan.json").exists()


def test_a_check_that_processes_died_in_twice_is_out_of_memory(tmp_path, monkeypatch):
    from kvram.remat import _check, _checker

    class Died(BaseException):
        """A process's end in a check (TensorFlow's GPU allocator aborting it)."""

    ran = []

    def step_check(*args, **kwargs):
        def inner(runs):
            ran.append(runs)
            raise Died

        return inner

    monkeypatch.setattr(_checker, "_step_check", step_check)
    model = small_model()
    chain, path, logs = remat.segments(model), str(tmp_path / "checks.json"), []

    def process():  # what a new process's estimate makes: the store read from the file
        batches = {8: _checker._batch(model, (32, 32, 3), 8)}
        return _checker.Checker(model, chain, batches, None, False, True, logs.append,
                                _plan_process.CheckStore(path), ("float32",)).at(8)

    for died in (1, 2):
        with pytest.raises(Died):
            process()(())
        kept = _plan_process.CheckStore(path)
        assert kept.died(next(iter(kept.started))) == died and kept.progress() == died
    peak = process()(())  # not run a third time
    assert isinstance(peak, _check._OutOfMemory) and len(ran) == 2
    kept = _plan_process.CheckStore(path)
    assert kept.started == {} and len(kept.checks) == 1 and kept.progress() == 2
    assert "out of memory" in logs[-1] and "the process died in it 2 time(s) before" in logs[-1], logs


@pytest.mark.slow
def test_cli_plan_child_ends_before_the_interpreter_exit_that_aborts(tmp_path, monkeypatch, capfd):
    # an abort at exit (after the estimate is printed) does not happen: the
    # child ends with os._exit once its work is done
    monkeypatch.setenv("KVRAM_TEST_ABORT_AT_EXIT", "1")
    code = _plan_in_child(tmp_path, monkeypatch, abort_at=0, once=False)
    out, err = capfd.readouterr()
    assert code == 0 and "was killed" not in err, err[-3000:]
    assert "<- recommended" in out
    assert json.loads((tmp_path / "checks.json").read_text())["finished"]["code"] == 0


def _finish_as_the_child(command, code=0):
    """What `kvram plan`'s estimate child does once done: says so in the checks
    file its command names, under its run (`--checks-file`, `--plan-child`)."""
    _plan_process.CheckStore(command[command.index("--checks-file") + 1]).finish(
        command[command.index("--plan-child") + 1], code)


def test_cli_plan_child_killed_after_it_finished_is_not_started_again(tmp_path, monkeypatch, capsys):
    import subprocess

    calls = []

    def finished_then_killed(command, **kwargs):
        calls.append(command)
        _finish_as_the_child(command)
        return -6

    monkeypatch.setattr(subprocess, "call", finished_then_killed)
    code = cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "16",
                     "--isolate", "always", "--checks-file", str(tmp_path / "checks.json")])
    assert code == 0 and len(calls) == 1
    assert "the estimate's process was killed by SIGABRT after it finished" in capsys.readouterr().err


@pytest.mark.parametrize("held, exact", [
    (None, False),  # a CPU
    (8 * 10**9 // 2**20 * 2**20, True),  # limited to 8GB by kvram plan --limit-gpu: whole MiB
    (8 * 10**9 // 2**20 * 2**20 - 2**20, False),  # a MiB less than asked for
    (80 * 2**30, True),  # a larger GPU
])
def test_checks_are_exact_where_the_gpu_holds_the_memory_asked_for(held, exact, monkeypatch):
    from kvram import memory
    from kvram.remat import _estimate

    monkeypatch.setattr(memory, "_device_name", lambda device: "CPU:0" if held is None else "GPU:0")
    monkeypatch.setattr(memory, "limit_bytes", lambda device: held)
    assert _estimate._checks_exact("auto", 8 * 10**9) is exact
    assert _estimate._checks_exact("batch", 8 * 10**9) and not _estimate._checks_exact("probes", 8 * 10**9)


_U = 2**30 // 100  # the unit of the figures below: 142 of them print as 1.42 GiB


class _Checks:
    """Stands in for an estimate's Checker: the step peak (in _U beyond the
    resident bytes) of each micro-batch size, out of memory where "oom", and
    the rows checked, in order."""

    name = "xla"

    def __init__(self, peaks, exact=True):
        self.peaks, self.exact, self.done = peaks, exact, []

    def at(self, rows):
        def check(runs):
            self.done.append(rows)
            return _plan_process._OutOfMemory(30 * _U) if self.peaks[rows] == "oom" else self.peaks[rows] * _U

        return check


def _rows(*rows):
    """Configurations (micro-batch size or None, remat, executor's predicted
    total in _U), 10 _U resident each, in the order of preference."""
    made = []
    for i, (micro, how, predicted) in enumerate(rows):
        c = remat.Configuration("float32", micro, how, predicted * _U, 1.0 + 0.1 * i, predicted <= 100,
                                executor_peak_bytes=predicted * _U)
        c._planning = (None, None, None, 10 * _U, micro or 256)
        made.append(c)
    return made


@pytest.mark.parametrize("peaks, checked, recommended, left", [
    # 64-row slices checked first; 128 scaled by them: (10 + 70) * 160 / 90 = 142, over the
    # limit (100) even at 90% of that, so not compiled
    ({64: 70}, [64], 64, "predicted 1.60 GiB, 1.42 GiB scaled by micro-batch 64's check (0.80 GiB of "
                         "0.90 predicted): over the limit (1.00 GiB) even at 90% of that"),
    # scaled (10 + 40) * 160 / 90 = 89, within: checked after 64, and preferred
    ({64: 40, 128: 85}, [64, 128], 128, None),
    ({64: 40, 128: 95}, [64, 128], 64, None),  # checked over the limit: the 64-row slices stand
    # fewer rows out of memory: more rows are not checked, the slices after them are
    ({64: "oom", 32: 50}, [64, 32], 32, "micro-batch 64, with fewer rows, checked over the limit"),
])
def test_a_slice_predicted_far_over_the_limit_waits_for_a_smaller_ones_check(peaks, checked, recommended, left):
    """kvram.remat._order: without recomputation, a configuration predicted
    over 1.5x the limit (and under 2x, above which none is checked) is
    checked only after the next one without recomputation, and only where
    that one's check, scaled by the two predictions, leaves it within."""
    from kvram.remat._order import _first_that_fits

    rows = _rows((None, "none", 201), (128, "none", 160), (64, "none", 90), (32, "none", 70))
    checks = _Checks(peaks)
    said = []
    chosen = _first_that_fits(rows, checks, 256, 100 * _U, said.append)
    assert checks.done == checked
    assert chosen.micro_batch_size == recommended and chosen.fits
    assert "even at 50% of that" in rows[0].not_checked and not rows[0].fits  # over 2x: never checked
    if left is None:
        assert rows[1].not_checked is None
    else:
        assert not rows[1].fits and left in rows[1].not_checked, rows[1].not_checked
        assert any("micro-batch 128, remat none: not checked" in line for line in said), said


@pytest.mark.parametrize("exact, predicted, checked", [
    (False, 160, [128]),  # at the probe batches, checks of rows without recomputation cost nothing more
    (True, 131, [128]),  # 1.31x the limit (ResNet50's 128-row slices on an H200): checked first, and fit
])
def test_a_slice_less_far_over_the_limit_is_checked_first(exact, predicted, checked):
    from kvram.remat._order import _first_that_fits

    rows = _rows((128, "none", predicted), (64, "none", 90))
    checks = _Checks({128: 60, 64: 40}, exact=exact)
    chosen = _first_that_fits(rows, checks, 256, 100 * _U, lambda line: None)
    assert checks.done == checked and chosen is rows[0]


def test_a_waiting_slice_is_checked_before_a_recomputing_one(monkeypatch):
    """No configuration without recomputation comes after it to scale by: the
    waiting one is checked, in its place in the order, before one that recomputes."""
    from kvram.remat import _order

    done = []
    monkeypatch.setattr(_order, "_checked_least", lambda c, checker, limit: done.append("least"))
    rows = _rows((128, "none", 160), (None, "least", 90))
    checks = _Checks({128: 60})
    chosen = _order._first_that_fits(rows, checks, 256, 100 * _U, lambda line: None)
    assert checks.done == [128] and done == [] and chosen is rows[0]


def test_a_fit_row_whose_search_found_nothing_is_not_taken(monkeypatch):
    """A "fit" row whose checked search found no choice within the limit is
    passed over, even where the check of its own choice came within it."""
    from kvram.remat import _order

    def search_found_nothing(c, checker, limit):
        c.fits = True  # its own choice's check, made when the search found nothing
        return False

    monkeypatch.setattr(_order, "_checked_fit", search_found_nothing)
    rows = _rows((None, "fit", 150), (64, "none", 90))
    checks = _Checks({64: 40})
    assert _order._first_that_fits(rows, checks, 256, 100 * _U, lambda line: None) is rows[1]


@pytest.mark.parametrize("exact, rows, profiled_at_rows", [
    (True, 256, True),  # checked at its own rows: a profile measured there is searched last
    (False, 256, False),  # checked at the probes: no profile beyond the probes'
    (True, 32, False),  # the row's rows are a probe's: its profile is the probes'
])
def test_a_fit_search_that_finds_nothing_from_the_probes_profiles_the_rows_themselves(
        monkeypatch, exact, rows, profiled_at_rows):
    """kvram.remat._order: where neither the probes' profile nor a second one
    gives a choice that checks within the limit, and configurations are checked
    at their own rows, the choices of a profile measured at the row's own rows
    are searched (XLA's peaks on the CPU followed only the choices of such a
    profile on one CI machine) before the row is taken not to fit."""
    import types

    from kvram.remat import _order, _plan

    first, again, own = "first profile", "second profile", "own rows' profile"
    monkeypatch.setattr(_order, "_probe_profiles", lambda *args: ("low", "high"))
    monkeypatch.setattr(_order, "_scaled", lambda *args: again)
    monkeypatch.setattr(_order, "_own_rows_profile", lambda model, chain, checker, at: own if at == rows else None)
    searched = []

    def plan_for(model, chain, profile, resident, limit, at, check):
        searched.append(profile)
        if profile != own:
            raise ValueError("the least peak, checked, is above the limit")
        return types.SimpleNamespace(recompute_fraction=0.3, predicted_peak_bytes=80 * _U, least_runs=((0, 2),))

    monkeypatch.setattr(_plan, "_plan_for", plan_for)
    (c,) = _rows((None, "fit", 150))
    c._planning = (None, None, first, 10 * _U, rows)
    c.plan = types.SimpleNamespace(recompute_fraction=0.1, runs=((1, 1),))
    checks = _Checks({rows: 140}, exact=exact)
    checks.batches, checks.loss, checks.least_runs, said = {16: None, 32: None}, None, {}, []
    checks.log = said.append
    found = _order._checked_fit(c, checks, 100 * _U)
    assert searched == [first, again] + ([own] if profiled_at_rows else []), searched
    assert said[0] == f"fit at {rows} rows: no choice checked within the limit; profiled again"
    if profiled_at_rows:
        assert said[1:] == [f"fit at {rows} rows: no choice checked within the limit; profiled at its {rows} rows"]
        assert found and c.fits and c.predicted_peak_bytes == 80 * _U and checks.least_runs == {rows: ((0, 2),)}
        assert c.relative_step_time == pytest.approx(1.2)  # the own rows' choice recomputes 0.3, not 0.1
    else:
        # the row shows its own choice's checked peak: 10 resident + 140
        assert not found and not c.fits and c.predicted_peak_bytes == 150 * _U and checks.least_runs == {}


def test_estimate_check_at_is_validated():
    with pytest.raises(ValueError, match=r'check_at must be "auto", "batch" or "probes". Received: check_at=\'all\''):
        remat.estimate(small_model, 16, memory_bytes=2**30, check_at="all")


@pytest.mark.slow
@pytest.mark.own_process
def test_a_check_out_of_memory_does_not_fit_and_the_plan_goes_on(request, monkeypatch):
    if in_own_process(request):  # run ahead, beside the suite (tests/helpers.py)
        return
    # The unmodified step, checked at the batch, runs out of the device's
    # memory (as on a GPU smaller than it needs): its row is marked "oom", does
    # not fit, and the plan with recomputation is still found and checked.
    import tensorflow as tf

    from kvram.layers import Checkpoint

    real = remat._check._step_peak_or_raise

    def plain_runs_out(model, *args):
        if not any(isinstance(layer, Checkpoint) for layer in model.layers):
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating (simulated)")
        return real(model, *args)

    monkeypatch.setattr(remat._check, "_step_peak_or_raise", plain_runs_out)
    batch = 64
    x = np.random.default_rng(0).random((batch, 32, 32, 3)).astype("float32")
    direct = remat.plan(small_model(), (x, np.arange(batch) % 10), budget_bytes=None, optimizer="adam")
    assert direct.plain_out_of_memory and "plain out of memory, over" in str(direct)
    memory = 2 * direct.minimum_peak_bytes
    found = remat.estimate(small_model, batch, memory_bytes=memory, precisions=("float32",),
                          micro_batch_sizes=[], margin=0.0, check_at="batch")
    rows = {c.remat: c for c in found.configurations}
    assert rows["none"].predicted_by == "oom" and not rows["none"].fits
    assert "oom = that step ran out of the device's memory" in str(found)
    recommended = found.recommended
    assert recommended is not None and recommended.remat in ("fit", "least") and recommended.fits
    assert recommended.predicted_by == "graph" and recommended.predicted_peak_bytes <= memory


def _checked_steps_peak(monkeypatch, plain_bytes, recomputing_bytes):
    """Checked steps (remat's `_step_peak_or_raise`) peak at `plain_bytes`
    without recomputation and at `recomputing_bytes` with any (as XLA's
    peaks need not follow the executor's prediction)."""
    from kvram.layers import Checkpoint

    def peak(model, *args):
        return recomputing_bytes if any(isinstance(layer, Checkpoint) for layer in model.layers) else plain_bytes

    monkeypatch.setattr(remat._check, "_step_peak_or_raise", peak)


@pytest.mark.slow
def test_fit_is_searched_by_checks_where_the_executor_predicts_nothing_fits(monkeypatch):
    # The cut-by-cut prediction puts even the least-memory choice over the
    # limit; the checks find choices within it. The "fit" row is searched,
    # and preferred (before this row existed only where the prediction put the
    # least-memory choice within the limit, and "least" alone was checked).
    batch = 64
    _checked_steps_peak(monkeypatch, 64 * 2**20, 2**20)
    found = remat.estimate(small_model, batch, memory_bytes=8 * 2**20, precisions=("float32",),
                          micro_batch_sizes=[], margin=0.0, check_at="batch")
    rows = {c.remat: c for c in found.configurations}
    assert rows["least"].executor_peak_bytes > 8 * 2**20, found  # predicted not to fit
    recommended = found.recommended
    assert recommended is rows["fit"] and recommended.fits and recommended.predicted_by == "graph", found
    assert recommended.predicted_peak_bytes <= 8 * 2**20
    assert recommended.plan.recompute_fraction <= rows["least"].plan.recompute_fraction, found


@pytest.mark.slow
def test_a_fit_row_with_nothing_within_the_limit_shows_its_checked_peak(monkeypatch):
    # No choice checks within the limit: the "fit" and "least" rows show
    # checked peaks (over the limit), not the executor's prediction.
    _checked_steps_peak(monkeypatch, 64 * 2**20, 32 * 2**20)
    found = remat.estimate(small_model, 64, memory_bytes=8 * 2**20, precisions=("float32",),
                          micro_batch_sizes=[], margin=0.0, check_at="batch")
    assert found.recommended is None and "nothing fits" in str(found)
    for c in found.configurations:
        if c.remat == "none":  # predicted over twice the limit: not checked
            assert c.predicted_by == "executor" and c.executor_peak_bytes > 2 * 8 * 2**20 and not c.fits, found
            continue
        resident = c.predicted_peak_bytes - 32 * 2**20  # variables, Adam's state and the batch: 0.92 MiB
        assert c.predicted_by == "graph" and not c.fits and 0 < resident < 2**20, found
    assert any("remat none: not checked, predicted" in m and "even at 50% of that" in m for _, m in found.log)


@pytest.mark.slow
def test_least_out_of_memory_says_nothing_fits(monkeypatch):
    import tensorflow as tf

    def out_of_memory(*args):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating (simulated)")

    monkeypatch.setattr(remat._check, "_step_peak_or_raise", out_of_memory)
    x = np.random.default_rng(0).random((16, 32, 32, 3)).astype("float32")
    with pytest.raises(ValueError, match="least-memory choice .* ran out of the device's memory .* nothing fits"):
        remat.plan(small_model(), (x, np.arange(16) % 10))


_QUICK = ("--xla_llvm_disable_expensive_passes=true --xla_gpu_enable_triton_gemm=false "
          "--xla_disable_hlo_passes=triton-softmax-rewriter")


@pytest.mark.parametrize("given, expected", [
    (None, f"--xla_gpu_autotune_level=0 {_QUICK}"),
    ("--xla_gpu_enable_cublaslt=true", f"--xla_gpu_enable_cublaslt=true --xla_gpu_autotune_level=0 {_QUICK}"),
    ("--xla_gpu_autotune_level=2", f"--xla_gpu_autotune_level=2 {_QUICK}"),  # the user's level stays
    # and so does the user's setting of any of the compile flags
    ("--xla_gpu_enable_triton_gemm=true",
     "--xla_gpu_enable_triton_gemm=true --xla_gpu_autotune_level=0 --xla_llvm_disable_expensive_passes=true "
     "--xla_disable_hlo_passes=triton-softmax-rewriter"),
    # a user's own list of passes to skip is left as it is
    ("--xla_disable_hlo_passes=algsimp",
     "--xla_disable_hlo_passes=algsimp --xla_gpu_autotune_level=0 --xla_llvm_disable_expensive_passes=true "
     "--xla_gpu_enable_triton_gemm=false"),
    (f"--xla_gpu_autotune_level=1 {_QUICK}", f"--xla_gpu_autotune_level=1 {_QUICK}"),
    # a flag whose name only begins with one of them names another flag
    ("--xla_gpu_enable_triton_gemm_any=true", f"--xla_gpu_enable_triton_gemm_any=true --xla_gpu_autotune_level=0 {_QUICK}"),
])
def test_plan_checks_compile_without_autotuning_unless_xla_flags_set_a_level(given, expected):
    environ = {"PATH": "/bin"} | ({"XLA_FLAGS": given} if given is not None else {})
    env = _plan_process.checking_environment(environ)
    assert env == environ | {"XLA_FLAGS": expected, "TF_CUDNN_USE_AUTOTUNE": "0"}
    assert environ.get("XLA_FLAGS") == given  # the caller's mapping is left as it was


@pytest.mark.parametrize("device, flags, expected", [
    ("CPU:0", None, True),  # XLA on a CPU times no candidate kernels
    ("GPU:0", None, False),  # XLA's default autotuning
    ("GPU:0", "--xla_gpu_autotune_level=0", True),
    ("GPU:0", f"--xla_gpu_autotune_level=0 {_QUICK}", True),  # as the estimate's child compiles
    ("GPU:0", "--xla_gpu_autotune_level=1", False),
    ("GPU:0", "--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=4", False),  # XLA reads the last
    ("GPU:0", "--xla_gpu_autotune_level_x=0", False),
])
def test_checks_measure_the_compiling_call_only_where_compiling_times_no_kernels(monkeypatch, device, flags,
                                                                               expected):
    from kvram.remat._check import _compiles_untuned

    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert _compiles_untuned(device) is expected


@pytest.mark.slow  # XLA compiles
def test_an_xla_check_on_the_cpu_runs_the_step_once_and_measures_a_later_runs_peak():
    # The compiling call's own run is measured (a second run costs a GPU without
    # autotuning as much as the first): one call, and the peak of a run after it
    import tensorflow as tf

    from kvram.remat._check import _loss_function, _step_peak_or_raise, _training_step
    from tests.helpers import run_with_peak

    model = small_model()
    x = tf.random.uniform((16, 32, 32, 3))
    y = tf.zeros((16,), "int64")
    step = _training_step(model, x, y, _loss_function(model, "sparse_categorical_crossentropy"), True)
    calls = []

    def counted(x, y=None):
        calls.append(None)
        return step(x, y)

    checked = _step_peak_or_raise(model, counted, x, y, "CPU:0", True)
    assert len(calls) == 1
    assert checked == run_with_peak(step, x, y, warm=True)[1] > 0


@pytest.mark.parametrize(("device", "flags", "expected"), [
    ("GPU:0", "--xla_gpu_autotune_level=0", True),
    ("GPU:0", None, False),
    ("CPU:0", None, False),  # XLA:CPU's runs of larger models allocate beyond it: the step is run
])
def test_untuned_gpu_checks_read_xlas_buffer_assignment(monkeypatch, device, flags, expected):
    from kvram.remat._check import _reads_assignment

    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert _reads_assignment(device) is expected


@pytest.mark.slow  # an XLA compile, 4 s on 2 cores
def test_a_check_reading_the_assignment_compiles_without_running_the_step(monkeypatch):
    # On the CPU the path is forced: the step is compiled, not run; the bytes read
    # are the assignment's temporary buffer and outputs (the gradients among them),
    # and a run of the step allocates at least that temporary buffer. (A CPU run's
    # measured peak is no closer bound: for this model 14.9, 16.8 and 22.0 MB in
    # three processes, the allocator counting whole chunks; the read 14.9 MB.)
    import numpy as np
    import tensorflow as tf

    from kvram.remat import _check
    from tests.helpers import run_with_peak

    model = small_model()
    x = tf.random.uniform((16, 32, 32, 3))
    y = tf.zeros((16,), "int64")
    step = _check._training_step(model, x, y, _check._loss_function(model, "sparse_categorical_crossentropy"), True)
    monkeypatch.setattr(_check, "_reads_assignment", lambda device: True)
    before = [v.numpy().copy() for v in model.variables]
    read = _check._step_peak_or_raise(model, step, x, y, "CPU:0", True)
    assert step.experimental_get_tracing_count() == 1  # traced for the compile
    # not run: BatchNormalization's moving statistics did not move
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.variables))
    kinds = _check._assignment(step, x, y)
    gradients = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)
    assert read == kinds["temp"] + kinds["outputs"] and kinds["outputs"] >= gradients
    assert kinds["parameters"] >= x.numpy().nbytes  # the variables and the batch: not counted
    assert run_with_peak(step, x, y, warm=True)[1] >= kinds["temp"] > 0


@pytest.mark.parametrize("given", [None, "0", "1"])
def test_plan_measures_without_cudnn_autotuning_unless_it_is_set(given):
    environ = {"PATH": "/bin"} | ({"TF_CUDNN_USE_AUTOTUNE": given} if given is not None else {})
    env = _plan_process.checking_environment(environ)
    assert env["TF_CUDNN_USE_AUTOTUNE"] == (given or "0")
    assert environ.get("TF_CUDNN_USE_AUTOTUNE") == given


def test_stage_lines_count_from_the_commands_start_in_its_children(monkeypatch, capsys):
    import time

    from kvram.remat._check import StageLog

    monkeypatch.setenv(_plan_process.STARTED, repr(time.time() - 100.0))
    log = StageLog(True)
    log("a stage")
    assert 100.0 <= log.lines[0][0] < 160.0, log.lines
    assert capsys.readouterr().err.startswith(f"[{log.lines[0][0]:7.1f} s] a stage")
    monkeypatch.delenv(_plan_process.STARTED)
    log = StageLog(False)
    log("another")
    assert 0.0 <= log.lines[0][0] < 60.0 and capsys.readouterr().err == "", log.lines


def _report(recommended_runs=((2, 3),)):
    """`Estimate.to_json`'s shape: two rows, the second recommended."""
    row = {"precision": "float32", "remat": "none", "predicted_peak_bytes": 3 * 2**20,
           "relative_step_time": 1.0, "fits": False, "predicted_by": "executor",
           "executor_peak_bytes": None, "not_checked": "over the limit", "micro_batch_size": None,
           "runs": [], "recommended": False}
    chosen = row | {"micro_batch_size": 8, "remat": "fit", "predicted_peak_bytes": 2**20,
                    "relative_step_time": 1.2, "fits": True, "predicted_by": "graph",
                    "not_checked": None, "runs": [list(r) for r in recommended_runs], "recommended": True}
    return {"memory_bytes": 2 * 2**20, "margin": 0.1, "batch_size": 16, "check_at": "batch",
            "configurations": [row, chosen], "segments": {"float32": ["a", "b"]}, "measured": None,
            "log": [[0.5, "measured cut by cut"]], "not_estimated": ["mixed_float16"],
            "state": {"float32": {"weights": 2**19, "optimizer": 2**20, "batches": 4096, "gradients": 2**19}}}


def test_an_estimate_read_back_from_its_json_is_the_same():
    report = _report()
    found = remat.Estimate.from_json(json.loads(json.dumps(report)))
    assert found.recommended is found.configurations[1] and found.recommended.runs == ((2, 3),)
    assert found.configurations[0].runs == () and found.plain_configuration() is found.configurations[0]
    again = found.to_json()
    assert json.loads(json.dumps(again)) == report | {"segments": {}}  # the segments are its plans', which JSON does not hold
    assert str(remat.Estimate.from_json(again)) == str(found) and "<- recommended" in str(found)
    assert "float32: weights 0.5 MiB, gradients 0.5 MiB" in str(found), str(found)


class _MeasuringChild:
    """A stand-in for `subprocess.Popen` of --measure's child: records its
    command, and when waited for, what it was told (`--measure-when`)."""

    def __init__(self, calls, code=0):
        self.calls, self.code = calls, code

    def __call__(self, command, env=None):
        self.calls.append(("measuring", command, env))
        self.command = command
        return self

    def wait(self):
        go = self.command[self.command.index("--measure-when") + 1]
        with open(go) as f:
            self.calls.append(("told", f.read()))
        return self.code


def _estimating_child(calls, estimate=True, code=0):
    """A stand-in for `subprocess.call` of the estimate's child: writes the
    estimate where the parent asked (`estimate`), then says it finished."""

    def child(command, env=None):
        calls.append(("estimating", command, env))
        if estimate:
            with open(command[command.index("--estimate-file") + 1], "w") as f:
                json.dump(_report(), f)
        _finish_as_the_child(command, code)
        return code

    return child


def test_cli_plan_measures_in_a_second_child_compiled_as_training_will_be(tmp_path, monkeypatch, capsys):
    import subprocess

    calls = []
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_cublaslt=true")
    monkeypatch.setattr(subprocess, "call", _estimating_child(calls))
    monkeypatch.setattr(subprocess, "Popen", _MeasuringChild(calls))
    code = cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "16", "--measure",
                     "--isolate", "always"])
    # --measure's child starts first (it imports TensorFlow meanwhile) and is
    # told to go once the estimate's process has ended
    assert code == 0 and [c[0] for c in calls] == ["measuring", "estimating", "told"], calls
    (_, measuring, measure_env), (_, estimating, env), told = calls
    assert told == ("told", "go")
    assert env["XLA_FLAGS"] == f"--xla_gpu_enable_cublaslt=true --xla_gpu_autotune_level=0 {_QUICK}"
    assert env["TF_CUDNN_USE_AUTOTUNE"] == "0"
    assert "--measure-from" not in estimating
    # the second child: the user's environment and the command's start (as the
    # first child's), this process as the one that tells it, the estimate's file
    started = env.pop(_plan_process.STARTED)
    assert measure_env == os.environ | {_plan_process.STARTED: started, _plan_process.PARENT: str(os.getpid())}
    assert "--plan-child" not in measuring
    assert _plan_process.STARTED not in os.environ  # this process's own is left as it was
    estimate_file = estimating[estimating.index("--estimate-file") + 1]
    assert measuring[-6:] == ["--isolate", "never", "--measure-from", estimate_file,
                              "--measure-when", f"{estimate_file}.go"]  # the last wins
    assert not os.path.exists(os.path.dirname(estimate_file))  # removed once measured


@pytest.mark.parametrize("estimate, code", [(False, 1), (True, 2)])
def test_cli_plan_tells_measures_child_to_stop_when_nothing_is_to_measure(monkeypatch, estimate, code):
    # nothing recommended (no estimate written), or the estimate's process failed
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "call", _estimating_child(calls, estimate=estimate, code=code))
    monkeypatch.setattr(subprocess, "Popen", _MeasuringChild(calls, code=0))
    assert cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "16", "--measure",
                     "--isolate", "always"]) == code
    assert [c[0] for c in calls] == ["measuring", "estimating", "told"] and calls[-1] == ("told", "stop")


def test_measures_child_waits_to_be_told(tmp_path, monkeypatch):
    import threading

    go = str(tmp_path / "estimate.json.go")
    monkeypatch.setenv(_plan_process.PARENT, str(os.getppid()))  # this process's parent "tells"
    threading.Timer(0.2, _plan_process.tell, (go, True)).start()
    assert _plan_process.wait_to_go(go, poll=0.01) is True
    _plan_process.tell(go, False)
    assert _plan_process.wait_to_go(go) is False
    # the process that would tell has ended: stop
    monkeypatch.setenv(_plan_process.PARENT, str(os.getppid() + 1))
    assert _plan_process.wait_to_go(str(tmp_path / "never.go"), poll=0.01) is False


def test_cli_plan_without_measure_starts_one_child(tmp_path, monkeypatch):
    import subprocess

    calls = []

    def child(command, env=None):
        calls.append(command)
        _finish_as_the_child(command)
        return 0

    monkeypatch.setattr(subprocess, "call", child)
    assert cli.main(["plan", "--model", "tests.test_plan:small_model", "--batch-size", "16",
                     "--isolate", "always"]) == 0
    assert len(calls) == 1 and "--estimate-file" not in calls[0]


@pytest.mark.slow
def test_cli_plan_in_children_checks_untuned_and_measures_as_given(tmp_path, monkeypatch, capfd):
    # the real children: the estimate's builds see XLA_FLAGS with autotuning off (and QUICK_COMPILE),
    # --measure's (another process) the user's XLA_FLAGS; each with the flag its `import kvram` adds
    # (kvram/_xla_flags.py FAST; the user's names the other)
    log = tmp_path / "flags.jsonl"
    monkeypatch.setenv("KVRAM_TEST_FLAGS_LOG", str(log))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_cublaslt=true")
    out = tmp_path / "plan.json"
    code = cli.main([
        "plan", "--model", "tests.helpers:flags_recording_model", "--batch-size", "16", "--gpu-memory", "1GB",
        "--precision", "float32", "--micro-batch-sizes", "none", "--measure", "--steps", "2",
        "--isolate", "always", "--json", str(out),
    ])
    printed, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    builds = [json.loads(line) for line in log.read_text().splitlines()]
    processes = list(dict.fromkeys(pid for pid, *_ in builds))
    assert len(processes) == 2, builds
    flags = {pid: {tuple(f) for p, *f in builds if p == pid} for pid in processes}
    added = "--xla_allow_excess_precision=false"
    assert flags[processes[0]] == {
        (f"--xla_gpu_enable_cublaslt=true --xla_gpu_autotune_level=0 {_QUICK} {added}", "0")
    }, builds
    assert flags[processes[1]] == {(f"--xla_gpu_enable_cublaslt=true {added}", None)}, builds
    # the estimate's process says when TensorFlow was imported, in the command's time
    assert "s] TensorFlow " in err and " imported" in err, err[-3000:]
    assert printed.count("<- recommended") == 1, printed
    assert printed.index("<- recommended") < printed.index("measured, 2 steps on CPU:0"), printed
    # the second process says what it trains while it does
    assert "s] --measure: training the recommendation (float32, micro-batch -, " in err, err[-3000:]
    assert "then plain Keras, for 2 steps after one that compiles" in err, err[-3000:]
    # and how far it got: each model's compiled first step, then its steps, in that order
    progress = [line.split("] ", 1)[1] for line in err.splitlines() if "] --measure: " in line][1:]
    assert [line.split(",")[0] for line in progress] == [
        "--measure: the recommendation: first step done (built and compiled)",
        "--measure: the recommendation: 2 steps done",
        "--measure: plain Keras: first step done (built and compiled)",
        "--measure: plain Keras: 2 steps done",
    ], err[-3000:]
    report = json.loads(out.read_text())
    assert report["measured"]["samples_per_second"] > 0 and report["measured"]["plain"]["peak_bytes"] > 0
    assert sum(c["recommended"] for c in report["configurations"]) == 1


@pytest.mark.parametrize("device, copies", [("CPU:0", 1), ("GPU:0", 3), ("GPU:1", 3)])
def test_plans_count_the_batches_kvram_model_prefetches_to_a_gpu(device, copies):
    import inspect

    from kvram.remat import _plan

    assert _plan.batch_copies(device) == copies
    default = inspect.signature(kvram.Model.__init__).parameters["prefetch_to_gpu"].default
    assert copies == 1 or copies == 1 + default


def test_resident_bytes_are_the_variables_the_optimizer_state_and_the_batches():
    import keras

    from kvram.remat import _plan

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(4)(inputs))  # 12 + 4 float32: 64 bytes
    assert _plan.resident_bytes(model, None, 100, "CPU:0") == 64 + 100
    assert _plan.resident_bytes(model, None, 100, "GPU:0") == 64 + 3 * 100  # the step's and 2 prefetched
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    moments = 2 * 64  # Adam's first and second moments, one of each per weight
    with_adam = _plan.resident_bytes(model, optimizer, 0, "CPU:0") - 64
    assert moments <= with_adam <= moments + 16  # and its step counter and learning rate
    assert _plan.resident_bytes(model, "adam", 0, "CPU:0") - 64 == with_adam  # an unbuilt one is counted built


@pytest.mark.slow  # a whole plan, checks included: 22.3 s on a 2-core VM without AVX-512
@pytest.mark.own_process
def test_plan_shows_its_stages_on_stderr_unless_verbose_is_0(request, capsys):
    if in_own_process(request):  # run ahead, beside the suite (tests/helpers.py)
        return
    x = np.random.default_rng(0).random((8, 32, 32, 3)).astype("float32")
    batch = (x, np.arange(8) % 10)
    model = small_model()
    found = remat.plan(model, batch, loss="sparse_categorical_crossentropy", jit_compile=False)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) >= 4, captured.err
    assert "segments; measuring its training step cut by cut at 8 rows on CPU:0" in lines[0], lines
    assert "measured cut by cut; checking choices as training will run them (on the graph executor)" in lines[1]
    checks = [line for line in lines if "checked (graph) with " in line]
    assert checks and all(line.startswith("[") and " s] " in line for line in lines), lines
    assert lines[-1].endswith(f"done: {len(found.runs)} recomputed run(s), predicted peak "
                              f"{found.predicted_peak_bytes / 2**20:,.1f} MiB "
                              f"(plain {found.plain_peak_bytes / 2**20:,.1f} MiB)"), lines
    found.with_budget((found.plain_peak_bytes + found.minimum_peak_bytes) // 2)
    assert all("checked (graph) with " in line for line in capsys.readouterr().err.splitlines())
    remat.plan(small_model(), batch, loss="sparse_categorical_crossentropy", jit_compile=False, verbose=0)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=r"verbose must be 0 or 1. Received: verbose=2"):
        remat.plan(model, batch, verbose=2)


def test_checks_of_one_recomputation_at_other_rows_share_its_trace(tmp_path):
    from kvram.remat import _checker

    model = small_model()
    chain = remat.segments(model)
    batches = {rows: _checker._batch(model, (32, 32, 3), rows) for rows in (4, 8)}
    checker = _checker.Checker(model, chain, batches, None, False, True, lambda line: None,
                               _plan_process.CheckStore(None), ("float32",))
    peaks = [checker.at(rows)(()) for rows in (4, 8, 16)]
    assert 0 < peaks[0] < peaks[1] < peaks[2], peaks  # each measured at its own rows
    (trained, step), = checker.steps.values()
    assert trained is model and step.experimental_get_tracing_count() == 1


def test_where_nothing_fits_the_table_says_whether_8_bit_moments_would():
    report = _report()
    report["configurations"][1] |= {"remat": "least", "fits": False, "recommended": False}
    report["state"]["float32"]["optimizer_8bit"] = 2**18  # saves 0.75 MiB of the 1 MiB
    found = remat.Estimate.from_json(report)
    assert found.recommended is None
    # the least-memory row, 1 MiB, less 0.75 MiB, within 0.9 x 2 MiB
    assert "optimizer state 0.2 MiB instead of 1.0 MiB; the least-memory row would take 0.2 MiB and fits" \
        in str(found), str(found)
    # 0.5 MiB of gradients: no less than 0.5 MiB without them, which might fit
    assert "update_in_backward=True): no step holds all 0.5 MiB of gradients; the least-memory row would take " \
        "no less than 0.5 MiB and might fit" in str(found), str(found)
    # without the old JSON's "masters", no host_offload line; with them, the state leaves the device
    assert "host_offload" not in str(found)
    report["state"]["float32"]["masters"] = 2**19
    assert "with kvram.Model(host_offload=True): the optimizer state (1.0 MiB) moves to host memory, beside " \
        "0.5 MiB of float32 master weights; the least-memory row would take 0.0 MiB and fits (predicted, not " \
        "checked; the host update's time is not predicted)" in str(remat.Estimate.from_json(report))
    report["state"]["float32"]["host_update_parameters_per_s"] = 2**17 * 10  # 2**17 parameters: 0.1 s
    assert "fits (predicted, not checked; the host's update of 131,072 parameters, measured on this host at 1M " \
        "parameters/s, adds 100 ms per update beside the copies)" in str(remat.Estimate.from_json(report))
    report["state"]["float32"]["host_update_parameters_per_s"] = 2**17 / 12.34
    assert "adds 12.3 s per update" in str(remat.Estimate.from_json(report))
    # what HostOffload would need of the host, and whether the host has it
    report["state"]["float32"]["host_need"] = 3 * 2**20
    assert "adds 12.3 s per update beside the copies); the host needs 3.0 MiB for it (HostOffload's defaults: the " \
        "masters, the state, a step's gradient copies, the update's working copies)\n" in \
        str(remat.Estimate.from_json(report)) + "\n"
    report["state"]["float32"]["host_available"] = 2 * 2**20
    assert "working copies), and has 2.0 MiB free: too little, HostOffload would refuse it" in \
        str(remat.Estimate.from_json(report))
    # with groups the update works on one weight at a time: less, which this host has
    report["state"]["float32"]["host_need_groups"] = 3 * 2**19
    assert "working copies), 1.5 MiB with HostOffload(groups=k), k >= 2 (the update then works on one weight at " \
        "a time), and has 2.0 MiB free\n" in str(remat.Estimate.from_json(report)) + "\n"
    # where host memory is pinned, the pinned allocator's limit too
    report["state"]["float32"]["host_pinned_limit"] = 2**20
    assert "and has 2.0 MiB free; host memory is pinned here, and TensorFlow's pinned allocator holds at most " \
        "1.0 MiB: set TF_GPU_HOST_MEM_LIMIT_IN_MB (MiB) above 2 before TensorFlow starts" in \
        str(remat.Estimate.from_json(report))
    report["configurations"][1]["predicted_peak_bytes"] = 3 * 2**20
    assert "would take 2.2 MiB and still does not fit" in str(remat.Estimate.from_json(report))
    assert "would take 2.0 MiB and still does not fit (predicted, not checked; the host" \
        in str(remat.Estimate.from_json(report))
    assert "no less than 2.5 MiB and still does not fit" in str(remat.Estimate.from_json(report))


def test_adam_and_adamw_have_an_8_bit_alternative_with_their_settings():
    from kvram.optimizers import AdamW8bit
    from kvram.remat._plan import eight_bit_alternative, optimizer_from

    assert isinstance(optimizer_from("adamw8bit"), AdamW8bit) and isinstance(optimizer_from("AdamW8bit"), AdamW8bit)
    alternative = eight_bit_alternative(keras.optimizers.AdamW(3e-4, weight_decay=0.01, beta_2=0.95))
    assert isinstance(alternative, AdamW8bit)
    assert (float(alternative.learning_rate), alternative.weight_decay, alternative.beta_2) == pytest.approx((3e-4, 0.01, 0.95))
    assert eight_bit_alternative("adam").weight_decay == 0.0
    assert eight_bit_alternative("sgd") is None and eight_bit_alternative(AdamW8bit()) is None


@pytest.mark.slow  # an estimate's checks, 2.3 s on 2 cores
def test_the_estimate_takes_adamw8bit_by_name():
    found = remat.estimate(small_model, 32, memory_bytes=10**5, precisions=("float32",), optimizer="adamw8bit")
    state = found.state["float32"]
    assert state["optimizer"] > 0 and "optimizer_8bit" not in state and "8-bit moments" not in str(found)
