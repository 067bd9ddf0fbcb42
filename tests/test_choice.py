"""The planner's choice (kvram.remat._choice) against brute force on short chains."""

import random

import pytest

from kvram.remat import _choice
from kvram.remat._profile import _Profile


def _profile(rng, n):
    kept = tuple(rng.randint(0, 10**6) for _ in range(n))
    return _Profile(
        kept=kept,
        need=tuple(rng.randint(10**6, 10**7) for _ in range(n)),
        recompute=tuple(None if rng.random() < 0.15 else rng.randint(0, 5 * 10**6) for _ in range(n)),
        transient=tuple(rng.randint(0, 10**6) for _ in range(n)),
        head=rng.randint(0, 10**7),
        output=tuple(rng.randint(0, k) for k in kept),
        input=rng.randint(0, 10**6),
        flops=tuple(rng.randint(1, 10**9) for _ in range(n)),
    )


def _every_choice(n):
    """Every set of disjoint runs (first, last) over n segments, in chain order."""
    def from_(i):
        if i >= n:
            yield ()
            return
        yield from from_(i + 1)  # segment i kept whole
        for last in range(i, n):
            for rest in from_(last + 1):
                yield ((i, last),) + rest
    return list(from_(0))


@pytest.mark.parametrize("seed", range(12))
def test_the_programme_recomputes_the_least_within_each_budget_and_finds_the_least_peak(seed):
    rng = random.Random(seed)
    profile = _profile(rng, rng.randint(1, 7))
    choices = _every_choice(len(profile.need))
    peaks = {runs: _choice._predict(profile, list(runs)) for runs in choices}
    least = min(peaks.values())
    low = _choice._minimum(profile)
    assert least <= low <= least + max(1, least // 1000)
    high = _choice._predict(profile, [])
    for budget in sorted({least - 1, low, *(int(low + f * (high - low)) for f in (0.1, 0.3, 0.6, 1.0))}):
        fitting = [runs for runs in choices if peaks[runs] <= budget]
        chosen = _choice._choose(profile, budget)
        if not fitting:
            assert chosen is None
            continue
        assert chosen is not None and peaks[tuple(chosen)] <= budget
        assert _choice._recomputed(profile, chosen) == min(_choice._recomputed(profile, r) for r in fitting)


def test_the_run_table_holds_each_runs_saving_and_need():
    profile = _profile(random.Random(99), 9)
    for j, rows in enumerate(_choice._run_table(profile)):
        assert [row[0] for row in rows] == list(range(j, 9))
        for k, flops, saving, need, worst in rows:
            assert flops == sum(profile.flops[j : k + 1])
            assert saving == _choice._saving(profile, j, k)
            assert need == _choice._run_need(profile, j, k)
            assert worst == max(profile.need[j : k + 1])


@pytest.mark.parametrize("seed", range(6))
def test_a_checked_budget_settles_no_choice_dearer_than_the_one_it_takes(seed):
    # A settled check is three more traces under one op order (kvram.remat._check's `settled`):
    # the search asks for one only where its answer can change the choice.
    from kvram.remat._plan import _fit_checked

    rng = random.Random(seed)
    profile = _profile(rng, rng.randint(3, 6))
    choices = _every_choice(len(profile.need))
    # checks that peak apart from the prediction, and settle higher still
    first = {runs: int(_choice._predict(profile, list(runs)) * rng.uniform(0.9, 1.1)) for runs in choices}
    final = {runs: int(peak * rng.uniform(1.0, 1.05)) for runs, peak in first.items()}
    first[()] = final[()] = max(final.values()) + 1  # the plain step: the highest peak
    settled = []

    def check(runs):
        return first[tuple(runs)]

    def settle(runs):
        settled.append(tuple(runs))
        return final[tuple(runs)]

    check.settled, check.known = settle, lambda: tuple(choices)  # every choice checked before
    low, candidates = _choice._minimum(profile), _choice._least_candidates(profile, _choice._minimum(profile))
    least_runs = min(choices, key=lambda r: final[r])
    plain, least = first[()], final[least_runs]
    assert plain > least
    cost = lambda runs: _choice._recomputed(profile, runs)  # noqa: E731
    for fraction in (0.2, 0.5, 0.8):
        target = int(least + fraction * (plain - least))
        settled.clear()
        runs = tuple(_fit_checked(profile, check, target, plain, least, least_runs, candidates, low))
        fitting = [r for r in choices if first[r] <= target and final[r] <= target]
        assert runs in fitting and cost(runs) == min(cost(r) for r in fitting), (runs, fraction)
        assert settled and all(cost(r) <= cost(runs) for r in settled), (runs, settled)
