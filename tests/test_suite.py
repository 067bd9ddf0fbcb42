"""How the suite itself runs (tests/conftest.py)."""

from tests import conftest


def test_two_workers_on_two_cores_none_with_a_gpu_or_one_core(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(conftest, "_GPUS", 0)
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0})
    assert conftest.pytest_xdist_auto_num_workers(None) == 0
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(conftest, "_GPUS", 1)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) == 3


def test_a_child_runs_its_test_in_its_own_process_whatever_the_workers():
    from tests.helpers import _pytest_args

    args = _pytest_args("tests/test_suite.py::x")
    assert args[args.index("-n") + 1] == "0" and args[-1] == "tests/test_suite.py::x"
