"""Steps 2 and 3 of planning (`_plan`'s docstring): the predicted peak of any
choice of runs to recompute, and the exact dynamic programme that chooses the
least recomputation within a budget; the least-memory candidates."""

from __future__ import annotations

import functools
import math

import numpy as np


def _runs(checkpointed):
    """[(first, last)] of the runs of consecutive True entries."""
    runs, start = [], None
    for i, flag in enumerate(list(checkpointed) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i - 1))
            start = None
    return runs


def _saving(profile, first, last) -> int:
    """Bytes freed for the rest of the step by recomputing segments first..last:
    what they kept, less their output, which stays for the next segment."""
    return sum(profile.kept[first : last + 1]) - profile.output[last]


def _run_need(profile, first, last) -> int:
    """The highest allocation while a checkpointed run first..last runs, before
    the savings of earlier runs: what its segments needed unmodified, or its
    recomputation, which starts when the gradient reaches its output (the
    later segments' weight gradients are held then, unlike in the forward pass)
    and adds the largest forward transient of its segments."""
    need = max(profile.need[first : last + 1])
    if profile.recompute[last] is None:
        return need
    # tf.recompute_grad recomputes from two copies of the run's input (an
    # identity, then an add that orders the recomputation after the gradient).
    copies = 2 * (profile.output[first - 1] if first else profile.input)
    return max(need, profile.recompute[last] + copies + max(profile.transient[first : last + 1]))


def _predict(profile, runs) -> int:
    """Predicted step peak (bytes beyond the step's start) when each run
    (first, last) of segments is one `Checkpoint`: the highest of `_stretches`."""
    return max([0] + [held for _, held in _stretches(profile, runs)])


def _stretches(profile, runs) -> list:
    """[(what, bytes)] of each stretch of the predicted step, in chain order:
    ("run", first, last) for a recomputed run, ("segment", i) for a segment
    kept whole, ("head",) for the loss and its gradient. A segment's stretch
    holds what it held unmodified, less the savings of the runs that end
    before it (a checkpointed run's own activations are all back while its
    backward pass runs)."""
    stretches, saved, r = [], 0, 0
    n = len(profile.need)
    i = 0
    while i < n:
        if r < len(runs) and runs[r][0] == i:
            first, last = runs[r]
            stretches.append((("run", first, last), _run_need(profile, first, last) - saved))
            saved += _saving(profile, first, last)
            r, i = r + 1, last + 1
        else:
            stretches.append((("segment", i), profile.need[i] - saved))
            i += 1
    stretches.append((("head",), profile.head - saved))
    return stretches


def _choose(profile, budget):
    """The runs with the least recomputed FLOPs whose predicted peak is within
    `budget` (bytes beyond the step's start), or None. Exact: a dynamic
    programme over the chain keeping, after each prefix, the Pareto front of
    (recomputed FLOPs, bytes saved so far).

    The fronts are numpy arrays, each state pointing back to the state it
    came from: EfficientNetB0's 85 segments (64x64, batch 32) make up to 34k
    states a front before the Pareto cut, 850k in all at half its budget
    range: 8.9 s a choice as Python tuples on 2 cores, 0.25 s so (the same
    choices, tests/test_choice.py). Among states equal in both,
    the one made first is kept, in the order the tuples were made (segment j
    kept whole, then its runs j..k for k ascending, state by state)."""
    n = len(profile.need)
    arrays, dtype = _run_arrays(profile)
    # parts[t]: the arrays of states made for the front after segment t-1, in the order
    # made: (flops, saved, index of the state it came from in front j, j, last segment of
    # its new run or -1 where segment t-1 was kept whole)
    parts = [[] for _ in range(n + 1)]
    parts[0].append((np.zeros(1, dtype), np.zeros(1, np.int64), np.zeros(1, np.int64),
                     np.zeros(1, np.int64), np.full(1, -1, np.int64)))
    fronts = []
    for j in range(n):
        flops, saved, came = _pareto_front(parts[j])
        fronts.append(came)
        limit = budget + saved
        index = np.arange(len(saved))
        ks, costs, gains, needs, worsts = arrays[j]
        # runs j..k each state may start: before the first k whose `worst` exceeds its limit
        # (`worst` only grows with k), saving bytes, within the limit
        ok = (worsts[None, :] <= limit[:, None]) & (gains[None, :] > 0) & (needs[None, :] <= limit[:, None])
        keep = profile.need[j] <= limit
        for col, k in enumerate(ks):
            take = ok[:, col]
            made = (flops[take] + costs[col], saved[take] + gains[col], index[take],
                    np.full(int(take.sum()), j, np.int64), np.full(int(take.sum()), k, np.int64))
            if k == j:  # the same front as segment j kept whole: state by state, kept first
                made = _interleave(
                    (flops[keep], saved[keep], index[keep], np.full(int(keep.sum()), j, np.int64),
                     np.full(int(keep.sum()), -1, np.int64)), keep, made, take)
            parts[k + 1].append(made)
    flops, saved, came = _pareto_front(parts[n])
    fronts.append(came)
    fits = np.flatnonzero(profile.head - saved <= budget)
    if not len(fits):
        return None
    state = int(fits[np.argmin(flops[fits])])  # the first of the least
    runs, t = [], n
    while t > 0:
        index, j, last = (int(v[state]) for v in fronts[t])
        if last >= 0:
            runs.append((j, last))
        state, t = index, j
    return tuple(reversed(runs))


def _interleave(kept, kept_mask, run, run_mask):
    """The states of segment j kept whole and of its run j..j, state by
    state (kept first), as the programme made them."""
    order = np.concatenate([np.flatnonzero(kept_mask) * 2, np.flatnonzero(run_mask) * 2 + 1])
    order = np.argsort(order, kind="stable")
    return tuple(np.concatenate([a, b])[order] for a, b in zip(kept, run))


def _pareto_front(parts):
    """(flops, saved, (index, j, last)) of the states in `parts` not beaten by
    another with no more FLOPs and at least as much saved, by FLOPs; of
    states equal in both, the first made."""
    flops, saved, index, j, last = (np.concatenate(column) for column in zip(*parts))
    order = np.lexsort((-saved, flops))  # stable: equal states stay in the order made
    flops, saved = flops[order], saved[order]
    best = np.maximum.accumulate(saved)
    kept = np.ones(len(saved), bool)
    kept[1:] = saved[1:] > best[:-1]
    kept &= saved >= 0
    keep = order[kept]
    return flops[kept], saved[kept], (index[keep], j[keep], last[keep])


@functools.lru_cache(maxsize=4)
def _run_arrays(profile):
    """`_run_table` as numpy arrays, once a profile: for each j, (k, FLOPs,
    saving, need, worst) each an array over k = j..n-1; and the FLOPs' dtype
    (int64 where every segment's FLOPs are ints, else float64)."""
    dtype = np.int64 if all(isinstance(f, int) for f in profile.flops) else np.float64
    arrays = []
    for rows in _run_table(profile):
        ks, costs, gains, needs, worsts = zip(*rows)
        arrays.append((np.array(ks, np.int64), np.array(costs, dtype),
                       *(np.array(column, np.int64) for column in (gains, needs, worsts))))
    return arrays, dtype


@functools.lru_cache(maxsize=4)
def _run_table(profile):
    """For each first segment j, [(k, FLOPs, `_saving`, `_run_need`, the
    highest `need` of segments j..k)] of the runs j..k, k = j..n-1: the
    programme's inner loop, computed once a profile (sums and maxima carried
    along k, the same values as `_saving` and `_run_need` give one by one:
    planning EfficientNetB0's 85 segments spent 78 s of 531 in `_choose` on
    2 cores when each was summed again)."""
    n = len(profile.need)
    table = []
    for j in range(n):
        copies = 2 * (profile.output[j - 1] if j else profile.input)
        rows, worst, cost, kept, transient = [], 0, 0, 0, 0
        for k in range(j, n):
            worst = max(worst, profile.need[k])
            cost += profile.flops[k]
            kept += profile.kept[k]
            transient = max(transient, profile.transient[k])
            need = worst if profile.recompute[k] is None else max(worst, profile.recompute[k] + copies + transient)
            rows.append((k, cost, kept - profile.output[k], need, worst))
        table.append(rows)
    return table


def _minimum(profile) -> int:
    """The least predicted step peak any choice reaches (bisection on the
    budget; each test is the largest saving reachable, greedy-exact on the
    chain)."""

    def feasible(budget):
        best = [-1] * (n + 1)
        best[0] = 0
        for j in range(n):
            saved = best[j]
            if saved < 0:
                continue
            if profile.need[j] - saved <= budget:
                best[j + 1] = max(best[j + 1], saved)
            for k, _, gain, need, worst in table[j]:
                if worst - saved > budget:
                    break
                if need - saved <= budget:
                    best[k + 1] = max(best[k + 1], saved + max(0, gain))
        return best[n] >= 0 and profile.head - best[n] <= budget

    n = len(profile.need)
    table = _run_table(profile)
    low, high = 0, _predict(profile, [])
    while high - low > max(1, high // 2000):
        middle = (low + high) // 2
        if feasible(middle):
            high = middle
        else:
            low = middle
    return high


# The least-memory candidates besides the programme's choice at its least
# predicted peak: its choices at these multiples of that peak (fewer, longer
# or shorter runs), every segment that saves recomputed alone, and the
# square-root split.
_LEAST_SLACK = (1.05, 1.1)


# Checked peaks within this fraction of the lowest count as equal: the one
# with the least recomputation is taken.
_LEAST_TIE = 0.02


def _sqrt_runs(n):
    """Chen et al. 2016's split: every segment recomputed, in runs of about
    sqrt(n) segments (only the runs' inputs are kept)."""
    k = max(1, round(math.sqrt(n)))
    return tuple((i, min(i + k, n) - 1) for i in range(0, n, k))


def _each_alone(profile):
    """Every segment whose recomputation saves bytes, each a run of its own:
    the most a chain of blocks saves where each block's output is small
    beside what it keeps (a transformer's blocks), whatever the measured
    stretches' peaks say."""
    return tuple((i, i) for i in range(len(profile.need)) if _saving(profile, i, i) > 0)


def _least_candidates(profile, low, every=True):
    """Choices that may reach the least peak: the programme's at its least
    predicted peak `low` (`_minimum`), and (`every`) its choices at
    `_LEAST_SLACK` times that, every saving segment alone and the
    square-root split (distinct, in that order)."""
    candidates = [tuple(_choose(profile, low))]
    if not every:
        return candidates
    for slack in _LEAST_SLACK:
        runs = _choose(profile, int(low * slack))
        if runs is not None:
            candidates.append(tuple(runs))
    alone = _each_alone(profile)
    if alone:
        candidates.append(alone)
    candidates.append(_sqrt_runs(len(profile.need)))
    return list(dict.fromkeys(candidates))


def _spread_candidates(profile, low):
    """The programme's choices at `_SPREAD` of the way from the least
    predicted peak `low` to the plain step's."""
    high = _predict(profile, [])
    found = [_choose(profile, int(low + f * (high - low))) for f in _SPREAD]
    return [tuple(runs) for runs in found if runs]


def _one_run_fewer(candidates):
    """Each candidate with one of its runs (of two or more) left out."""
    return [r[:i] + r[i + 1:] for r in candidates if len(r) > 1 for i in range(len(r))]


# Where `_spread_candidates` takes the programme's choices, from the least
# predicted peak (0) to the plain step's (1).
_SPREAD = (0.1, 0.2, 0.35, 0.5)


def _recomputed(profile, runs) -> int:
    """Forward FLOPs recomputed by `runs`."""
    return sum(profile.flops[i] for a, b in runs for i in range(a, b + 1))
