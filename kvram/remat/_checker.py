"""Checks of the configurations an estimate considers (`_estimate`): a step run
as training will run it, at a configuration's rows or extrapolated from the
probe batches, each kept in a file as it is made so that an estimate stopped
midway (TensorFlow can abort a process after a GPU step out of memory) goes on
from them."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import tensorflow as tf

from kvram import memory
from kvram._version import __version__
from kvram.remat._check import _OutOfMemory, _free_bytes, _loss_function, _step_check


def _size(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Checker:
    """Checks of one precision's model: steps run as training will
    (XLA-compiled or on the graph executor; see `kvram.remat`'s step 4), at a
    configuration's own rows (`exact`) or at the probe batches (see `at`) with the
    result extrapolated linearly in rows. A check out of the device's memory
    gives a `_OutOfMemory`."""

    def __init__(self, model, chain, batches, loss, jit, exact, log, store, identity):
        self.model, self.chain, self.batches, self.jit, self.exact, self.log = (
            model, chain, batches, jit, exact, log)
        self.loss, self.loss_fn = loss, _loss_function(model, loss)
        self.device = memory._device_name(None)
        # checks kept across processes, under what identifies the step: the
        # device and its memory too (a step out of memory under one limit
        # need not be under another), the versions that compile it and XLA's
        # flags (`kvram plan`'s checks compile without autotuning)
        self.store = store
        self.identity = (*identity, self.device, memory.limit_bytes(self.device), tf.__version__,
                         keras.__version__, __version__, os.environ.get("XLA_FLAGS", ""))
        self.checks = {}
        # each recomputation's model and traced step, shared by the checks at every rows
        self.steps = {}
        self.name = "xla" if jit else "graph"
        # {rows: the least-memory runs a "fit" row's checked search found}
        self.least_runs = {}

    def batch(self, rows):
        """(x, y) of `rows` rows: a probe batch, or one made as they are."""
        return self.batches.get(rows) or _batch(self.model, tuple(self.model.inputs[0].shape[1:]), rows)

    def _check(self, rows):
        """The check of a step at `rows` (a function of the recomputed runs)."""
        if rows not in self.checks:
            x, y = self.batch(rows)
            inner = _step_check(self.model, self.chain, x, y, self.loss_fn, self.device, self.jit,
                                steps=self.steps)
            seen = set()

            def check(runs):
                runs = tuple(runs)
                key = json.dumps([*self.identity, self.jit, rows, [list(r) for r in runs]], default=str)
                peak = self.store.get(key)
                kept, died = peak is not None, self.store.died(key)
                if not kept and died >= _DIED_OUT_OF_MEMORY:
                    # The process died in this check each time it ran it (TensorFlow's GPU
                    # allocator aborted one in a step out of memory): it does not fit.
                    peak = _OutOfMemory(self.store.started[key]["floor"])
                    self.store.put(key, peak)
                elif not kept:
                    self.store.start(key, _free_bytes(self.device))
                    peak = inner(runs)
                    self.store.put(key, peak)
                if runs not in seen:
                    seen.add(runs)
                    self.log(f"checked ({self.name}) at {rows} rows with {len(runs)} recomputed run(s): "
                             + (f"out of memory (over {_size(peak)})" if isinstance(peak, _OutOfMemory)
                                else f"step peak {_size(peak)}") + (" (from the checks file)" if kept else "")
                             + (f" (the process died in it {died} time(s) before)" if died else ""))
                return peak

            check.known = lambda: tuple(seen)
            self.checks[rows] = check
        return self.checks[rows]

    def at(self, rows):
        """A function of the runs giving the checked step peak at `rows`.

        Extrapolated (not `exact`): linearly from the two probes, and from the
        larger probe and a third check at twice its rows (at most `rows`, where
        that check is the answer), the higher of the two: a step's peak can
        grow faster at larger sizes than between the probes. XLA on the CPU: a
        residual model recomputing three runs peaked at 4.0, 8.0, 32.0 and
        64.0 MiB at 8, 16, 32 and 64 rows, so the line through 8 and 16 rows
        gave half its peak at 64 rows (tests/test_plan.py's XLA estimate test,
        when it checked at the probes, failed so one run in three). A third
        check out of the present device's memory leaves the probes' line."""
        if self.exact or rows in self.batches:
            return self._check(rows)
        low_rows, high_rows = sorted(self.batches)
        low, high = self._check(low_rows), self._check(high_rows)
        third_rows = min(rows, 2 * high_rows)
        third = self._check(third_rows) if third_rows > high_rows else None

        def line(x0, a, x1, b):
            return int(round(a + (b - a) * (rows - x0) / (x1 - x0)))

        def extrapolated(runs):
            a, b = low(runs), high(runs)
            value = line(low_rows, a, high_rows, b)
            if isinstance(a, _OutOfMemory) or isinstance(b, _OutOfMemory):
                return _OutOfMemory(max(value, a, b))
            c = third(runs) if third is not None else None
            if c is None or isinstance(c, _OutOfMemory):
                return value
            if third_rows == rows:
                return c
            return max(value, line(high_rows, b, third_rows, c))

        def known():  # runs checked at every row the extrapolation reads: free to ask again
            sets = [set(f.known()) for f in (low, high, third) if f is not None]
            return tuple(r for r in sets[0] if all(r in other for other in sets[1:]))

        extrapolated.known = known
        return extrapolated


# A check the process died in this many times (each in a process of its own) is
# out of memory: once may be the aftermath of an earlier step out of memory.
_DIED_OUT_OF_MEMORY = 2


def _batch(model, shape, rows):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((rows, *shape)).astype("float32"))
    classes = int(model.outputs[0].shape[-1] or 1)
    return x, tf.constant(rng.integers(0, classes, rows))
