"""Which of an estimate's configurations are checked, and when (`_estimate`):
in the order of preference until one fits, leaving unchecked those whose
prediction alone says they do not fit, and a "fit" or "least" row checked by
a search of checked choices (`_plan._plan_for`)."""

from __future__ import annotations

import dataclasses

import keras

from kvram import memory
from kvram.remat import _check as checking
from kvram.remat import _plan
from kvram.remat import _profile as profiling


def _scaled(low, high, rows_low, rows_high, rows):
    """Each field of two `_Profile`s extrapolated linearly to `rows`."""
    t = (rows - rows_low) / (rows_high - rows_low)

    def line(a, b):
        if a is None or b is None:
            return None
        return int(round(a + (b - a) * t))

    fields = {}
    for field in dataclasses.fields(low):
        a, b = getattr(low, field.name), getattr(high, field.name)
        fields[field.name] = tuple(line(u, v) for u, v in zip(a, b)) if isinstance(a, tuple) else line(a, b)
    return dataclasses.replace(low, **fields)


# The least share of the cut-by-cut prediction a step without recomputation is taken
# to check at: one predicted over the limit by more is not checked.
# On an H200 (benchmarks/results/plan_minute_h200/ at commit 1fb3fe3), XLA-compiled steps checked
# at 0.65x their prediction (ResNet50, 128 rows, bf16) and 0.82x (ViT-B/16, 64
# rows); each check of a configuration out of memory cost 24-49 s of compiling,
# and ResNet50's whole batch (predicted 16.2 GiB under a 6.7 GiB limit) aborted
# its process in TensorFlow's GPU allocator twice before it was taken as out of memory.
_CHECKED_AT_LEAST = 0.5


# A configuration without recomputation predicted over the limit by more than this
# (and under 1 / _CHECKED_AT_LEAST) fits only where XLA keeps under 1 / 1.5 of the
# cut-by-cut prediction. Checked at its own rows, it is checked after the next one
# without recomputation, and only if that check, scaled to its prediction, leaves it
# within the limit (`_scaled_checks`). On an H200, XLA kept 0.63x the prediction of
# ResNet50's 128-row slices (9.40 GB predicted under a 7.2 GB limit: 1.31x, checked
# first) and 0.86x of ViT-B/16's 64-row slices, while its 128-row slices (predicted
# 1.61x the limit) were compiled for 22-32 s only to run out of memory
# (benchmarks/results/plan_minute_h200/ at commit 1fb3fe3).
_DEFERRED_OVER = 1.5
# Of a scaled check, the share taken: a deferred configuration is left unchecked only
# when this share of the scaled peak is over the limit (XLA's share of the prediction
# is not the same at every rows).
_SCALED_SHARE = 0.9


def _first_that_fits(configurations, checker, batch_size, limit, log):
    """The first of one precision's configurations, in the order of preference
    (the least predicted step time, fewer slices first at equal time), that
    fits once checked; None if none does."""
    preference = sorted(configurations, key=lambda c: (
        c.relative_step_time, _slices(batch_size, c.micro_batch_size)))
    deferred = []  # preferred to those after them; checked once one of those is (_DEFERRED_OVER)
    for c in preference:
        why = _not_checked(c, limit)
        if why is not None:
            _leave(c, why, log)
            continue
        if checker.exact and c.remat == "none" and c.executor_peak_bytes > _DEFERRED_OVER * limit:
            deferred.append(c)
            continue
        if deferred and c.remat != "none":  # no check without recomputation to scale them by
            found, deferred = _first_checked(deferred, checker, limit), []
            if found is not None:
                return found
        fits = _checked(c, checker, limit)
        if deferred:
            found, deferred = _scaled_checks(deferred, c, checker, limit, log), []
            if found is not None:
                return found
        if fits:
            return c
    return _first_checked(deferred, checker, limit)


def _not_checked(c, limit):
    """Why `c` is left unchecked, its prediction alone saying it does not fit, or None."""
    resident = c._planning[3]
    if resident > limit:
        # Variables, optimizer state, batch (and accumulators) alone
        # are over the limit: no step fits, so none is checked.
        return (f"its variables, optimizer state and batch alone ({resident / 2**20:,.1f} MiB) "
                f"are over the limit ({limit / 2**20:,.1f} MiB)")
    if c.remat == "none" and c.executor_peak_bytes * _CHECKED_AT_LEAST > limit:
        # No recomputation, over the limit even at the least share of its prediction
        # a check has come to: not checked (a compiled step, likely out of memory).
        # Rows that recompute are searched by checks (`_checked_fit`) however high their
        # prediction: XLA can keep much less than the executor's prediction there.
        return (f"predicted {c.executor_peak_bytes / 2**30:,.2f} GiB, over the limit "
                f"({limit / 2**30:,.2f} GiB) even at {_CHECKED_AT_LEAST:.0%} of that")
    return None


def _leave(c, why, log):
    c.fits, c.not_checked = False, why
    log(f"{c.precision}: micro-batch {c.micro_batch_size or '-'}, remat {c.remat}: not checked, {why}")


def _checked(c, checker, limit) -> bool:
    """Checks `c` (a "fit" or "least" row by a search of checked choices):
    whether it fits, to be taken."""
    keras.config.set_dtype_policy(c.precision)
    if c.remat == "fit":
        # a search that found no choice within the limit is not taken, whatever
        # the check of the row's own choice then says
        return _checked_fit(c, checker, limit) and c.fits
    if c.remat == "least":
        _checked_least(c, checker, limit)
    else:
        _check(c, checker, limit)
    return c.fits


def _first_checked(configurations, checker, limit):
    """The first of `configurations` that fits once checked, or None."""
    for c in configurations:
        if _checked(c, checker, limit):
            return c
    return None


def _scaled_checks(deferred, checked, checker, limit, log):
    """The first of `deferred` (configurations without recomputation, with
    more rows than `checked`, one without recomputation just checked) that
    fits: each is checked only where `checked`'s peak, scaled by the two
    predictions, leaves it within the limit (at `_SCALED_SHARE`); None if none
    fits."""
    for c in deferred:
        if not checked.fits:
            _leave(c, f"predicted {c.executor_peak_bytes / 2**30:,.2f} GiB, and micro-batch "
                      f"{checked.micro_batch_size or '-'}, with fewer rows, checked over the limit", log)
            continue
        scaled = checked.predicted_peak_bytes * c.executor_peak_bytes / checked.executor_peak_bytes
        if scaled * _SCALED_SHARE > limit:
            _leave(c, f"predicted {c.executor_peak_bytes / 2**30:,.2f} GiB, {scaled / 2**30:,.2f} GiB "
                      f"scaled by micro-batch {checked.micro_batch_size or '-'}'s check "
                      f"({checked.predicted_peak_bytes / 2**30:,.2f} GiB of "
                      f"{checked.executor_peak_bytes / 2**30:,.2f} predicted): over the limit "
                      f"({limit / 2**30:,.2f} GiB) even at {_SCALED_SHARE:.0%} of that", log)
            continue
        if _checked(c, checker, limit):
            return c
    return None


def _slices(batch_size, micro_batch_size) -> int:
    """Slices a step of `batch_size` rows runs in (the last may be short)."""
    return 1 if micro_batch_size is None else -(-batch_size // micro_batch_size)


def _check(c, checker, limit):
    """Replaces c's peak by the checked one of its runs."""
    model, chain, profile, resident, rows = c._planning
    runs = c.runs
    peak = checker.at(rows)(runs)
    c.predicted_peak_bytes = resident + peak
    c.predicted_by = "oom" if isinstance(peak, checking._OutOfMemory) else checker.name
    c.fits = c.predicted_by != "oom" and c.predicted_peak_bytes <= limit


def _checked_fit(c, checker, limit) -> bool:
    """Re-plans a "fit" row with checks; False when no choice fits (the
    least-memory choice, checked, does not either)."""
    model, chain, profile, resident, rows = c._planning
    # The cut-by-cut profile, from which the choices come, varies from run to
    # run on the graph executor, and XLA's peaks need not follow it: on the CPU
    # (its allocator's peaks at 32, 64 or 128 MiB) a residual model at 64 rows
    # peaked lower than without recomputation with none of its 45 single runs
    # but with the programme's least-memory pair of runs of a profile at 64
    # rows, while profiles extrapolated from 8 and 16 rows gave, on one CI
    # machine, only choices XLA kept as high, twice running.
    # Before the row is taken not to fit, the choices of a second profile at
    # the probes are checked, then (where configurations are checked at their
    # own rows) those of one measured at the row's own rows, as `remat.plan`
    # measures a batch.
    attempts = [("", lambda: profile), ("profiled again", lambda: _scaled(
        *_probe_profiles(model, chain, checker.batches, checker.loss), *sorted(checker.batches), rows))]
    if checker.exact and rows not in checker.batches:
        attempts.append((f"profiled at its {rows} rows", lambda: _own_rows_profile(model, chain, checker, rows)))
    for said, make in attempts:
        if said:
            checker.log(f"fit at {rows} rows: no choice checked within the limit; {said}")
        try:
            chosen = _plan._plan_for(model, chain, make(), resident, limit, rows, checker.at(rows))
            break
        except ValueError:  # the least peak, checked, is above the limit too (or out of memory)
            continue
    else:
        _check(c, checker, limit)  # the row shows its own choice's checked peak
        return False
    checker.least_runs[rows] = chosen.least_runs
    _replace_plan(c, chosen, checker, limit)
    return c.fits


def _checked_least(c, checker, limit):
    """Re-plans a "least" row with checks: the least-memory candidates (and
    those a "fit" row's search checked) are checked, the lowest taken."""
    model, chain, profile, resident, rows = c._planning
    try:
        chosen = _plan._plan_for(model, chain, profile, resident, None, rows, checker.at(rows),
                                 checker.least_runs.get(rows))
    except ValueError:  # the least-memory choice ran out of the device's memory
        _check(c, checker, limit)
        return
    _replace_plan(c, chosen, checker, limit)


def _replace_plan(c, chosen, checker, limit):
    # the new choice's recomputation in place of the old one's (the slices' cost stays)
    c.relative_step_time += chosen.recompute_fraction - c.plan.recompute_fraction
    c.plan, c.predicted_peak_bytes = chosen, chosen.predicted_peak_bytes
    c.predicted_by, c.fits = checker.name, chosen.predicted_peak_bytes <= limit


def _own_rows_profile(model, chain, checker, rows):
    """The cut-by-cut profile at `rows` themselves, not extrapolated (a step
    out of the device's memory is measured in windows, and the log says so)."""
    return _probe_profiles(model, chain, {rows: checker.batch(rows)}, checker.loss, checker.log)[0]


def _probe_profiles(model, chain, batches, loss, log=None):
    """The cut-by-cut profiles at the probe batches ({rows: (x, y)}), fewest rows
    first; `log`, if given, is told where a step is measured in windows
    (`_profile._profiles`)."""
    return profiling._profiles(model, chain, [batches[rows] for rows in sorted(batches)],
                               checking._loss_function(model, loss), memory._device_name(None), log=log)
