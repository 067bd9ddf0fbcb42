"""`find_max_batch_size`: the largest micro-batch a compiled `kvram.Model`
trains with, by probes that leave the model as they found it."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.utils import io_utils

from kvram import _checks
from kvram.memory import collect_garbage, is_out_of_memory
from kvram.training import Model
from kvram.training._model import train_function_for
from kvram.training._step import unique


class BatchSizeSearch(NamedTuple):
    """What `find_max_batch_size` found: the size and every probe, in order."""

    size: int
    probes: list


def find_max_batch_size(
    model,
    sample_batch,
    low: int = 1,
    high: int | None = None,
    margin: float = 0.1,
    verbose: int = 1,
) -> BatchSizeSearch:
    """The largest micro-batch a compiled `kvram.Model` trains with, and the probes.

    Each probe runs one full training step (forward, backward, update; with the
    gradient sum of a second slice) on `sample_batch`'s rows repeated to the probed
    size (one compiled step serves every size), catches an out-of-memory error if one comes, and puts every weight,
    optimizer and metric variable back as it was: the model is unchanged
    afterwards. Sizes grow by doubling from `low` until one fails (when `high`
    is given and at least 8x `low`, `high` is probed first), then the search
    bisects (in log space) between the largest size that trained and the
    smallest that failed, until the returned size is within `margin` of the
    true maximum.

    Args:
        model: a compiled `kvram.Model`.
        sample_batch: `(x, y)` or `(x, y, sample_weight)` with at least one row.
        low: int >= 1, the smallest size; an error is raised if it does not fit.
        high: None or int >= low, the largest size worth trying.
        margin: float in (0, 1), relative precision of the answer.
        verbose: 0 or 1, print each probe.

    Returns:
        `BatchSizeSearch(size, probes)`; each probe is a dict with `size`,
        `fits`, `seconds` and `error` (the OOM message's first line, or None).

    Raises:
        RuntimeError: when `low` does not fit.
    """
    if not isinstance(model, Model):
        raise TypeError(
            f"find_max_batch_size needs a kvram.Model. Received: a {type(model).__name__}"
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError("Compile the model before find_max_batch_size(model, ...).")
    low = _checks.positive_int("low", low)
    high = _checks.positive_int("high", high, allow_none=True)
    if high is not None and high < low:
        raise ValueError(f"`high` must be >= `low`. Received: low={low}, high={high}")
    margin = _checks.positive_float("margin", margin)
    if margin >= 1:
        raise ValueError(f"`margin` must be in (0, 1). Received: margin={margin!r}")
    sample_batch = tuple(sample_batch) if isinstance(sample_batch, (list, tuple)) else (sample_batch,)
    rows = int(np.shape(next(t for t in tree.flatten(sample_batch) if t is not None))[0])
    if rows < 1:
        raise ValueError("`sample_batch` must hold at least one row. Received: 0 rows")

    probes: list[dict] = []
    previous_size, previous_function = model._micro_batch_size, model.train_function
    function = train_function_for(model)
    function.build(tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), sample_batch
    ))
    # One compiled gradient pass for every probed size (its size is an argument).
    gradients = function.gradients_function(tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), sample_batch
    ))
    apply = function.apply_function()
    saved = [(v, v.numpy()) for v in _all_variables(model, function)]

    def probe(size: int) -> bool:
        index = np.arange(size + 1) % rows  # size rows, plus a one-row second slice
        batch = tree.map_structure(
            lambda t: None if t is None else tf.gather(tf.convert_to_tensor(t), index),
            sample_batch,
        )
        model._micro_batch_size = size
        started = time.perf_counter()
        error_text = None
        try:
            logs = apply(gradients(batch, tf.constant(size, tf.int32)))
            tree.map_structure(lambda t: np.asarray(t), logs)  # wait for the device
            fits = True
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as error:
            if not is_out_of_memory(error):
                raise
            fits, error_text = False, str(error).strip().splitlines()[0][:200]
        finally:
            for variable, value in saved:
                variable.assign(value)
            del batch
            collect_garbage()
        probes.append(
            {
                "size": size,
                "fits": fits,
                "seconds": time.perf_counter() - started,
                "error": error_text,
            }
        )
        if verbose:
            io_utils.print_msg(
                f"find_max_batch_size: {size} {'fits' if fits else 'out of memory'}"
            )
        return fits

    try:
        if not probe(low):
            raise RuntimeError(
                f"find_max_batch_size: not even low={low} rows fit in memory "
                f"({probes[-1]['error']})."
            )
        good, bad = low, None
        if high is not None:
            bad = high + 1
            if high >= 8 * low and high > low:
                if probe(high):
                    return BatchSizeSearch(high, probes)
                bad = high
        else:
            while True:  # growth
                size = 2 * good
                if probe(size):
                    good = size
                else:
                    bad = size
                    break
        # Bisection in log space, until any size above `good` that might fit is
        # within `margin` of it.
        while bad - good > 1 and (bad - 1) * (1 - margin) > good:
            size = int(round(math.sqrt(good * bad)))
            size = min(max(size, good + 1), bad - 1)
            if probe(size):
                good = size
            else:
                bad = size
        return BatchSizeSearch(good, probes)
    finally:
        model._micro_batch_size = previous_size
        model.train_function = previous_function


def _all_variables(model, function) -> list:
    variables = list(model.variables) + list(model.metrics_variables) + function.step_state.counters()
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    return unique(variables)
