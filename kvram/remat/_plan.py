"""Planning: `plan(model, sample_batch, budget_bytes)` chooses which segments to recompute
so that a training step fits a memory budget with the least recomputation:

1. *Measure* one training step of the model as it is, on the device it will
   train on (one compiled step, `tf.function` without XLA), with a probe at each
   cut in the forward and in the backward pass that reads TensorFlow's allocator:
   the bytes each segment leaves held for the backward pass, and the peak of
   every stretch of the step. Where that step runs out of the device's memory, it
   is measured in windows of segments, the rest recomputed (`_profile._windowed`).
2. *Predict* the peak of any choice: checkpointing a run of segments frees what
   those segments kept (less the one tensor the run hands on) for every later
   part of the step, and costs one more forward pass of the run.
3. *Choose* by an exact dynamic programme over the chain: the least
   recomputation (forward FLOPs derived from the layers' shapes) whose predicted
   peak fits the budget; with no budget, the least peak that checkpointing can
   reach (the point Chen et al. 2016's square-root split aims at), with the
   least recomputation that reaches it.
4. *Check*: the unmodified step, the least-memory candidates (step 3's
   choice, its choices a few percent above that peak, and the square-root
   split: step 2 errs most where most is recomputed) and the chosen one are
   each run on the sample batch as training will run them, and their
   allocator peaks replace the predictions; the least-memory choice is the
   candidate with the lowest checked peak. Under XLA (by default on a GPU,
   where Keras compiles the step with XLA) the step is XLA-compiled: XLA
   fuses and reschedules it, so step 1's measurement over-predicts it
   (ResNet50 on an H200: 1.44-1.55x), and fixes its buffers at compile time,
   so one run gives its peak. Otherwise the step runs on the graph executor,
   without step 1's probes (which order the ops), the highest of three runs.
   When the chosen one is over the budget, the budget given to step 3 is
   lowered by the overshoot (mapped between the two measured ends) and
   step 3 repeats.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
from keras import tree

from kvram import memory
from kvram.remat._check import (
    StageLog, _OutOfMemory, _batch, _loss_function, _rows, _step_check, _uses_xla, new_garbage_only,
)
from kvram.remat._choice import (
    _choose,
    _least_candidates,
    _minimum,
    _one_run_fewer,
    _predict,
    _recomputed,
    _spread_candidates,
    _LEAST_TIE,
)
from kvram.remat._profile import _Profile, _profile
from kvram.remat._segments import _chain, _functional, _groups, rebuild
from kvram.training import Model
from kvram.training._model import PREFETCH_TO_GPU


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


@dataclasses.dataclass
class Plan:
    """Which segments of a model to recompute, and what that is predicted to
    cost. Made by `plan`; `apply()` builds the model; `str(plan)` is a table.

    Byte counts are totals for training: `resident_bytes` (the model's
    variables, the optimizer's, the batch; on a GPU also the batches
    `kvram.Model` prefetches there, `batch_copies`) plus the training step's peak.

    Attributes:
        model: the model planned for.
        segments: `segments(model)`.
        runs: (first, last) segment indices of each run recomputed as one
            `Checkpoint`.
        budget_bytes: the budget asked for (None: least memory).
        resident_bytes: variables of the model and optimizer, and the batch
            (times `batch_copies` of the device).
        batch_size: rows of the batch planned for.
        predicted_peak_bytes: predicted peak with this plan.
        plain_peak_bytes: measured peak of the unmodified model's step.
        minimum_peak_bytes: least predicted peak any plan reaches.
        recompute_fraction: predicted extra compute, as a fraction of the
            unmodified step's (forward and backward taken as 3 forward passes).
        checked: True when the three peaks are measured peaks of the steps
            (see the module docstring, step 4; `plan` always checks); False
            when they are predicted from the cut-by-cut measurement.
    """

    model: keras.Model
    segments: list
    runs: tuple
    budget_bytes: int | None
    resident_bytes: int
    batch_size: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    minimum_peak_bytes: int
    recompute_fraction: float
    profile: _Profile = dataclasses.field(repr=False)
    checked: bool = False
    check: object = dataclasses.field(default=None, repr=False, compare=False)
    # The unmodified step, checked, ran out of the device's memory:
    # plain_peak_bytes is then a lower bound.
    plain_out_of_memory: bool = False
    # The runs behind minimum_peak_bytes, once the least-memory candidates
    # were checked (for `with_budget`); None before.
    least_runs: tuple | None = dataclasses.field(default=None, repr=False)
    # `state_bytes` of the model, optimizer and batch planned for (None: not counted)
    state: dict | None = dataclasses.field(default=None, repr=False)

    def with_budget(self, budget_bytes) -> "Plan":
        """The plan for another budget (None: least memory), from the same
        measurement (no step is run, except, for a checked plan, the XLA
        check of a choice not checked before)."""
        with new_garbage_only():
            chosen = _plan_for(
                self.model, self.segments, self.profile, self.resident_bytes,
                _check_budget(budget_bytes), self.batch_size, self.check, self.least_runs,
            )
        chosen.state = self.state
        return chosen

    def predict(self, runs) -> int:
        """Predicted peak (total bytes) if `runs` were recomputed instead."""
        return self.resident_bytes + _predict(self.profile, list(runs))

    def groups(self):
        """(groups, checkpoint flags) for `rebuild`: each run recomputed, the
        segments between runs kept plain in one group each."""
        return _groups(self.runs, len(self.segments))

    def apply(self, policy: str = "full") -> Model:
        """A `kvram.Model` computing the same function as `model` on the
        **same variables** (the same weights, trained together; no copies),
        with each planned run under `kvram.layers.Checkpoint(policy=policy)`.
        The plan's peaks are those of "full"; "save_dots" keeps more (each
        run's Dense/EinsumDense products) and recomputes less."""
        return rebuild(self.model, *self.groups(), policy=policy)

    def __str__(self) -> str:
        recomputed = {i for first, last in self.runs for i in range(first, last + 1)}
        p = self.profile
        rows = [
            f"kvram.remat plan for {self.model.name!r}: {len(self.segments)} segments, "
            f"{len(self.runs)} recomputed run(s)",
            f"{'seg':>4}  {'layers':<44} {'kept MiB':>9} {'output MiB':>10} {'GFLOP':>7}  recompute",
        ]
        for s in self.segments:
            names = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
            rows.append(
                f"{s.index:>4}  {names[:44]:<44} {_mib(p.kept[s.index]):>9} "
                f"{_mib(p.output[s.index]):>10} {p.flops[s.index] / 1e9:>7.2f}  "
                f"{'yes' if s.index in recomputed else ''}"
            )
        budget = "none (least memory)" if self.budget_bytes is None else f"{_mib(self.budget_bytes)} MiB"
        rows.append(f"budget: {budget}; resident (variables, optimizer, batch): {_mib(self.resident_bytes)} MiB")
        if self.state is not None:
            st = self.state
            step = self.predicted_peak_bytes - self.resident_bytes
            rows.append(
                f"  weights {_mib(st['weights'])} MiB, optimizer state {_mib(st['optimizer'])} MiB, "
                f"batches {_mib(st['batches'])} MiB; planned step {_mib(step)} MiB: gradients "
                f"{_mib(st['gradients'])} MiB, activations and the rest {_mib(max(step - st['gradients'], 0))} MiB")
        rows += [
            f"peak: plain {'out of memory, over ' if self.plain_out_of_memory else ''}"
            f"{_mib(self.plain_peak_bytes)} MiB, planned "
            f"{_mib(self.predicted_peak_bytes)} MiB, least possible "
            f"{_mib(self.minimum_peak_bytes)} MiB ("
            + ("each measured as an XLA-compiled step" if getattr(self.check, "jit", False)
               else "each measured as a step on the graph executor" if self.checked
               else "plain measured, the others predicted") + ")",
            f"extra compute: {100 * self.recompute_fraction:.1f}% of a training step (predicted)",
        ]
        return "\n".join(rows)


def optimizer_from(optimizer):
    """A Keras optimizer from a name Keras knows ("adam", "adamw", ...) or
    "adamw8bit" (`kvram.optimizers.AdamW8bit`), or the optimizer given."""
    if isinstance(optimizer, str) and optimizer.lower() == "adamw8bit":
        from kvram.optimizers import AdamW8bit

        return AdamW8bit()
    return keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer


def eight_bit_alternative(optimizer):
    """`kvram.optimizers.AdamW8bit` with `optimizer`'s settings where it is
    Keras's Adam or AdamW (its moments in 8 bits), else None."""
    from kvram.optimizers import AdamW8bit

    optimizer = optimizer_from(optimizer)
    if type(optimizer) not in (keras.optimizers.Adam, keras.optimizers.AdamW) or optimizer.amsgrad:
        return None
    config = {k: v for k, v in optimizer.get_config().items() if k in ("learning_rate", "beta_1", "beta_2", "epsilon")}
    return AdamW8bit(weight_decay=getattr(optimizer, "weight_decay", None) or 0.0, **config)


def _optimizer_bytes(model, optimizer) -> int:
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if optimizer is None:
        return 0
    optimizer = optimizer_from(optimizer)
    if not optimizer.built:
        # A fresh copy of it, built on the model's variables to count its state.
        optimizer = optimizer.__class__.from_config(optimizer.get_config())
        optimizer.build(model.trainable_variables)
    return sum(_nbytes(v) for v in optimizer.variables)


def _nbytes(variable) -> int:
    return int(math.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def _check_budget(budget_bytes):
    if budget_bytes is None:
        return None
    if (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0
            or budget_bytes == math.inf):
        raise ValueError(
            f"budget_bytes must be a positive number of bytes or None. Received: {budget_bytes!r}"
        )
    return int(budget_bytes)


def plan(model, sample_batch, budget_bytes=None, *, loss=None, optimizer=None, jit_compile="auto",
         verbose=1) -> Plan:
    """Chooses the segments of `model` to recompute so that training fits
    `budget_bytes`, with the least recomputation (see the module docstring).

    Runs measured training steps of `model` on `sample_batch` (on the default
    device: the GPU when there is one). The steps move BatchNormalization's
    moving statistics and seed states; each puts them back
    (`kvram.memory.state_kept`), so the model's variables, and its
    optimizer's, are bit-identical afterwards.

    Args:
        model: a functional Keras model (see `segments`).
        sample_batch: x, or (x, y), at the batch size that will be trained;
            x one array, or a list or dict of arrays for a model with several
            inputs (a KerasHub backbone's `{"token_ids": ..., "padding_mask":
            ...}`).
        budget_bytes: the most memory training may use on the device, counting
            the variables of the model and the optimizer, the batch and the
            step's peak. None: the least memory checkpointing can reach.
        loss: the training loss (a Keras loss name or callable); default the
            model's compiled loss, else a mean square of the outputs (the loss
            changes activation memory only by its own temporaries).
        optimizer: the optimizer (instance or name) whose state to count;
            default the model's compiled one, else none.
        jit_compile: whether training will run under XLA, so that the choice
            is checked by XLA-compiled steps rather than graph-executor steps
            (module docstring, step 4). "auto": on a GPU when Keras would
            compile the model with XLA (`Model.compile`'s default), else not.
        verbose: 1 (default): a line on stderr for each stage, with the seconds
            since the start: the cut-by-cut measurement, each checked step (on
            a GPU each is an XLA compile: a GPT-2-medium-shaped decoder's plan
            took 354 s on an H200), the choice; later checks of the plan's
            `with_budget` too. 0: silent.

    Returns:
        A `Plan`; `plan(...).apply()` is the model to train.

    Raises:
        TypeError, ValueError: a model that cannot be cut (see `segments`), a
            malformed batch, a `jit_compile` not True, False or "auto", or a
            budget that is not a positive number of bytes or below the least
            this model can reach (the message gives it).
    """
    if verbose not in (0, 1) or isinstance(verbose, float):
        raise ValueError(f"verbose must be 0 or 1. Received: verbose={verbose!r}")
    model = _functional(model)
    chain = _chain(model)
    budget_bytes = _check_budget(budget_bytes)
    x, y = _batch(sample_batch)
    device = memory._device_name(None)
    loss_fn = _loss_function(model, loss)
    jit = _uses_xla(model, jit_compile, device)
    batch = sum(int(np.prod(t.shape)) * t.dtype.size for t in tree.flatten((x, y)) if t is not None)
    state = state_bytes(model, optimizer, batch, device)
    resident = state["weights"] + state["optimizer"] + state["batches"]
    if budget_bytes is not None and budget_bytes < resident:
        # no step fits beside what stays on the device: said before any step is measured
        raise ValueError(
            f"budget_bytes={budget_bytes:,} ({_mib(budget_bytes)} MiB) is below the least memory this "
            f"model can train in at batch {_rows(x)}: its variables, optimizer state and batch alone take "
            f"{resident:,} bytes ({_mib(resident)} MiB), before any step. Allowed: budget_bytes above "
            "that; or a smaller batch, or mixed precision."
        )
    log = StageLog(verbose)
    log(f"{model.name!r}: {len(chain)} segments; measuring its training step cut by cut at {_rows(x)} rows "
        f"on {device}")
    with new_garbage_only():
        check = _step_check(model, chain, x, y, loss_fn, device, jit, log)
        check.jit = jit
        profile = _profile(model, chain, x, y, loss_fn, device, log)
        how = "XLA-compiled" if jit else "on the graph executor"
        log(f"measured cut by cut; checking choices as training will run them ({how})")
        chosen = _plan_for(model, chain, profile, resident, budget_bytes, _rows(x), check)
    chosen.state = state
    log(f"done: {len(chosen.runs)} recomputed run(s), predicted peak {_mib(chosen.predicted_peak_bytes)} MiB "
        f"(plain {_mib(chosen.plain_peak_bytes)} MiB)")
    return chosen


def state_bytes(model, optimizer, batch_bytes: int, device: str) -> dict:
    """What stays on `device` beside a training step, by kind: "weights" (the
    model's variables), "optimizer" (the state of `optimizer`, else of the
    model's; none if neither), "batches" (`batch_bytes` times
    `batch_copies(device)`); and, inside each step, "gradients": one per
    trainable weight (frozen weights, as `enable_lora` leaves them, have none)."""
    return {
        "weights": sum(_nbytes(v) for v in model.variables),
        "optimizer": _optimizer_bytes(model, optimizer),
        "batches": batch_copies(device) * batch_bytes,
        "gradients": sum(_nbytes(v) for v in model.trainable_variables),
    }


def resident_bytes(model, optimizer, batch_bytes: int, device: str) -> int:
    """What stays on `device` beside a training step: the model's variables,
    the optimizer's state (`optimizer`, else the model's; none if neither),
    and a batch of `batch_bytes` times `batch_copies(device)`."""
    state = state_bytes(model, optimizer, batch_bytes, device)
    return state["weights"] + state["optimizer"] + state["batches"]


def batch_copies(device: str) -> int:
    """Batches on `device` while a planned model trains: the step's own, and on
    a GPU those `kvram.Model`'s `fit()` copies ahead (`PREFETCH_TO_GPU`). On
    one H200, ResNet50's `kvram plan --measure` (batch 256 of 154 MB, 8GB)
    measured 0.66 GiB over its prediction, which counted one batch
    (benchmarks/results/plan_minute_h200/README.md at commit 1fb3fe3)."""
    return 1 + (PREFETCH_TO_GPU if device.startswith("GPU") else 0)


_CHECK_TRIES = 3


def _least_runs(profile, check, candidates):
    """The least-memory runs: the candidate with the lowest checked peak (the
    least recomputation among those within `_LEAST_TIE` of it). The
    prediction errs most here, where most is recomputed (EfficientNetB0 on
    the CPU: the programme's choice checked at 0.40-0.55x of plain from run
    to run, its prediction 17-18% under its check in two runs), so which
    candidate is lowest changes with the model and the run."""
    # an _OutOfMemory (a lower bound) ranks after every measured peak
    peak = {runs: (isinstance(check(runs), _OutOfMemory), int(check(runs))) for runs in candidates}
    best = min(peak.values())
    if best[0]:
        return candidates[0]
    near = [r for r in candidates if not peak[r][0] and peak[r][1] <= best[1] * (1 + _LEAST_TIE)]
    return min(near, key=lambda r: _recomputed(profile, r))


def _plan_for(model, chain, profile, resident, budget_bytes, batch, check=None, least_runs=None) -> Plan:
    low = _minimum(profile)
    candidates = _least_candidates(profile, low, every=check is not None)
    searched = least_runs is not None
    if least_runs is None:
        least_runs, searched = candidates[0], check is None
        # The candidates are checked when the least memory is asked for, or
        # when the programme's least-memory choice checks over the budget.
        if check is not None and (budget_bytes is None or check(least_runs) > budget_bytes - resident):
            least_runs, searched = _least_runs(profile, check, candidates), True
            # Checked steps need not follow the executor's prediction (XLA on
            # the CPU: with its last three segments recomputed, a residual
            # model peaked as high as without recomputation at 32 and 64 rows,
            # other choices at half): before saying nothing fits, the
            # programme's choices across the range are checked, then each
            # candidate with one of its runs left out.
            for more in (lambda _: _spread_candidates(profile, low), _one_run_fewer):
                if budget_bytes is None or check(least_runs) <= budget_bytes - resident:
                    break
                candidates = list(dict.fromkeys(candidates + more(candidates)))
                least_runs = _least_runs(profile, check, candidates)
    if check is None:
        plain, least = _predict(profile, []), low
        peak_of = lambda runs: _predict(profile, list(runs))  # noqa: E731
    else:
        # the runs reported (the least-memory ones and the choice) with the
        # peak of a settled check (`_step_check`'s `settled`)
        settle = getattr(check, "settled", check)
        plain, least = check(()), settle(least_runs)
        peak_of = settle
        if isinstance(least, _OutOfMemory):
            raise ValueError(
                f"At batch {batch}, the least-memory choice ({len(least_runs)} recomputed run(s)) "
                f"ran out of the device's memory when checked (it needs more than the "
                f"{_mib(least)} MiB that were free): nothing fits. Allowed: a smaller batch, "
                "mixed precision, or a device with more memory."
            )
    if budget_bytes is None:
        runs = least_runs
    else:
        if budget_bytes - resident < least:
            raise ValueError(
                f"budget_bytes={budget_bytes:,} ({_mib(budget_bytes)} MiB) is below the least "
                f"memory this model can train in at batch {batch}: {resident + least:,} bytes "
                f"({_mib(resident + least)} MiB: {_mib(resident)} MiB of variables, optimizer "
                f"state and batch, and a step peak of {_mib(least)} MiB with checkpointing). "
                "Allowed: budget_bytes >= that; or a smaller batch, or mixed precision."
            )
        if check is None:
            runs = tuple(_choose(profile, budget_bytes - resident))
        else:
            runs = _fit_checked(profile, check, budget_bytes - resident, plain, least, least_runs, candidates, low)
    total = sum(profile.flops)
    return Plan(
        model=model,
        segments=chain,
        runs=runs,
        budget_bytes=budget_bytes,
        resident_bytes=resident,
        batch_size=batch,
        predicted_peak_bytes=resident + peak_of(runs),
        plain_peak_bytes=resident + plain,
        minimum_peak_bytes=resident + least,
        least_runs=least_runs if searched else None,
        recompute_fraction=_recomputed(profile, runs) / (3 * total),
        profile=profile,
        checked=check is not None,
        check=check,
        plain_out_of_memory=isinstance(plain, _OutOfMemory),
    )


def _fit_checked(profile, check, target, plain, least, least_runs, candidates, low):
    """The runs with the least recomputation found whose checked peak is
    within `target`. The executor's prediction and XLA's measurement are
    mapped onto each other linearly between the plain step and the
    least-memory one; `_choose` is given `target` so mapped, then, while its
    choice checks over `target`, a budget lowered by the overshoot (mapped
    the same way) and `_LOWER_AT_LEAST` of the range more, the step doubling
    until `_choose` answers with runs not checked yet (a choice 0.1% over
    would otherwise be chosen again), up to `_CHECK_TRIES` checks, and no
    further once its choice recomputes no less than a choice already checked
    within `target` (for another budget of the same check). Falls back to
    the runs with the least recomputation whose checked peak is within
    `target` among those checked and the least-memory candidates
    (`_least_candidates`; the least-memory runs are one: `target` >= their
    checked peak)."""
    if plain <= target and not isinstance(plain, _OutOfMemory):
        return ()
    high = _predict(profile, [])
    if isinstance(plain, _OutOfMemory):
        # Its peak is unknown beyond the floor: the prediction's, scaled as the
        # least-memory step's measured peak is to its prediction.
        plain = max(int(plain), int(high * least / max(low, 1)))
    scale = (high - low) / max(plain - least, 1)
    budget = min(high, low + int((target - least) * scale))

    settle = getattr(check, "settled", check)

    def fits(runs):  # an _OutOfMemory's floor is over the target too
        # The plan reports a choice's settled peak (the median of three
        # traces): a choice whose first trace fitted and whose settled peak
        # did not was reported over its budget (the residual chain: 42.6 MiB
        # for a budget of 41.6). Settled only once the first trace fits.
        first = check(runs)
        if isinstance(first, _OutOfMemory) or first > target:
            return False
        return settle(runs) <= target

    def cost(runs):
        return _recomputed(profile, runs)

    # Choices checked before (for other budgets, or the least-memory
    # candidates), free to ask again: the least recomputing of those within
    # `target` ends the search once the programme's choice recomputes no less
    # (its least recomputation only grows as its budget is lowered).
    known = getattr(check, "known", tuple)()
    best = _cheapest_fitting(known, fits, cost)
    checked = []
    runs = _choose(profile, budget)
    while runs is not None and len(checked) < _CHECK_TRIES:
        if best is not None and cost(runs) >= cost(best):
            break
        checked.append(tuple(runs))
        if fits(checked[-1]):
            return checked[-1]
        step = max(1, int((check(checked[-1]) - target) * scale)) + int(_LOWER_AT_LEAST * (high - low))
        runs = None
        while runs is None and budget - step >= low:
            budget -= step
            runs = _choose(profile, budget)
            if runs is not None and tuple(runs) in checked:
                runs, step = None, 2 * step
    found = _cheapest_fitting(list(candidates) + checked + list(known), fits, cost)
    return least_runs if found is None else found


def _cheapest_fitting(runs, fits, cost):
    """min((r for r in runs if fits(r)), key=cost, default=None), asking `fits`
    in order of cost only until one fits: `fits` settles a choice (three more
    traces under one op order) and a plan's earlier checks are many."""
    for candidate in sorted(dict.fromkeys(runs), key=cost):  # stable: the first of equal cost
        if fits(candidate):
            return candidate
    return None


# How much further than the overshoot (a fraction of the range of predicted
# peaks) `_fit_checked` lowers the programme's budget after a choice checks
# over it: the prediction's error varies from choice to choice (MobileNetV3Small
# on the CPU: a choice 7.9 MiB over, lowered by that, checked 0.9 over; lowered
# by that, 0.03 over).
_LOWER_AT_LEAST = 0.01
