"""How the suite itself runs (tests/conftest.py)."""

import os

import pytest


@pytest.fixture
def conftest(request):
    """tests/conftest.py as pytest loaded it (imported again under another name, a second copy
    would hold a worker's start-up lock for good: tests/conftest.py, _STARTING)."""
    path = os.path.join(os.path.dirname(__file__), "conftest.py")
    return next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path)


def test_two_workers_on_two_cores_none_with_a_gpu_or_one_core(conftest, monkeypatch):
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


def test_without_n_the_suite_asks_for_auto_workers_but_not_in_a_child_or_a_worker(conftest, monkeypatch):
    import types

    def config(numprocesses, xdist=True):
        return types.SimpleNamespace(option=types.SimpleNamespace(numprocesses=numprocesses),
                                     pluginmanager=types.SimpleNamespace(hasplugin=lambda name: xdist))

    for variable in ("KVRAM_TEST_ISOLATED", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(variable, raising=False)
    for given, xdist, wanted in ((None, True, "auto"), (0, True, 0), (3, True, 3), (None, False, None)):
        chosen = config(given, xdist)
        conftest.pytest_cmdline_main(chosen)
        assert chosen.option.numprocesses == wanted, (given, xdist)
    for variable in ("KVRAM_TEST_ISOLATED", "PYTEST_XDIST_WORKER"):  # a child, or a worker: no workers of its own
        with monkeypatch.context() as scope:
            scope.setenv(variable, "1")
            child = config(None)
            conftest.pytest_cmdline_main(child)
            assert child.option.numprocesses is None, variable
