"""The GPU-timeline analysis the benchmarks' published idle times come from
(benchmarks/profile/kernels.py), on made-up timelines."""

from benchmarks.profile.kernels import gaps, host_busy, host_during_gaps

# (name, start_us, dur_us, stream, op): a kernel, a device-to-host copy, 2 ms
# idle, a kernel; then a 30 us launch gap and a last kernel
KERNELS = [
    ("fusion_1", 0.0, 100.0, "Stream #1", "fusion.1"),
    ("MemcpyD2H", 100.0, 10.0, "Stream #2", "while/LogicalAnd/_6:_HostRecv"),
    ("fusion_2", 2110.0, 100.0, "Stream #1", "fusion.2"),
    ("fusion_3", 2240.0, 60.0, "Stream #1", "fusion.3"),
]
# (name, start_us, dur_us, thread)
HOST = [
    ("XlaLaunch", 0.0, 90.0, "tf_Compute/12"),
    ("ExecutorState::Process", 300.0, 1500.0, "tf_Compute/12"),
    ("IteratorGetNext", 1900.0, 100.0, "tf_data/3"),
    ("before the window", -500.0, 100.0, "python"),
]


def test_gaps_name_copies_by_op_and_sort_gaps_into_bands():
    found = gaps(KERNELS, steps=1)
    assert found["gaps_per_step"] == {"under_50us": 1, "50us_to_1ms": 0, "1ms_or_more": 1}
    assert found["idle_ms_per_step"]["1ms_or_more"] == 2.0
    assert found["largest"][0] == {"ms": 2.0, "after": "MemcpyD2H [while/LogicalAnd/_6:_HostRecv]",
                                   "before": "fusion_2"}


def test_host_during_gaps_counts_what_overlapped_each_long_gap():
    found = host_during_gaps(KERNELS, HOST, steps=1)
    assert found["gaps"] == 1  # the 30 us gap is under 50 us
    host = dict(found["host_ms_per_step"])
    assert host == {"ExecutorState::Process @tf_Compute/12": 1.5, "IteratorGetNext @tf_data/3": 0.1}
    assert found["largest"][0]["after"].startswith("MemcpyD2H [")


def test_host_busy_sums_events_inside_the_gpu_window_by_thread_kind():
    found = host_busy(HOST, KERNELS, steps=1)
    assert found["window_ms_per_step"] == 2.3
    busy = {name: (ms, count) for name, ms, count in found["events_ms_per_step"]}
    assert busy == {"ExecutorState::Process @tf_Compute": (1.5, 1), "IteratorGetNext @tf_data": (0.1, 1),
                    "XlaLaunch @tf_Compute": (0.09, 1)}


def test_torch_children_start_without_folders_that_hold_a_cudnn(tmp_path):
    from benchmarks.common import torch_environment

    staged, plain = tmp_path / "staged", tmp_path / "plain"
    staged.mkdir(), plain.mkdir()
    (staged / "libcudnn.so.9").write_bytes(b"")
    (plain / "libcudart.so.12").write_bytes(b"")
    environ = {"LD_LIBRARY_PATH": f"{staged}:{plain}::/nonexistent", "PATH": "/bin"}
    env = torch_environment(environ)
    assert env["LD_LIBRARY_PATH"] == f"{plain}:/nonexistent"
    assert env["PATH"] == "/bin" and environ["LD_LIBRARY_PATH"].startswith(str(staged))  # the given one unchanged
