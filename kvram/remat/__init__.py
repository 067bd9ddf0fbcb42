"""Checkpointing any functional Keras model, and planning it to a memory
budget: where its graph can be cut (`segments`), the same model rebuilt with
chosen stretches recomputed (`rebuild`), the least recomputation that fits a
budget (`plan`), and every precision x micro-batch x checkpointing
configuration predicted for a GPU (`estimate`, `kvram plan`), measured on
request (`measure`).

Parts, in the order planning uses them: `_segments` (cuts), `_profile` (one
step measured cut by cut), `_choice` (predictions and the dynamic programme),
`_check` (a choice checked by running its step), `_plan` (`plan`, `Plan`),
`_checker` (an estimate's checks, kept in a file), `_estimate`, `_measure`.
"""

from kvram.remat._estimate import Configuration, Estimate, estimate, parse_bytes
from kvram.remat._measure import measure
from kvram.remat._plan import Plan, plan
from kvram.remat._segments import Segment, rebuild, segments

__all__ = [
    "Segment",
    "segments",
    "rebuild",
    "plan",
    "Plan",
    "estimate",
    "measure",
    "Estimate",
    "Configuration",
    "parse_bytes",
]
