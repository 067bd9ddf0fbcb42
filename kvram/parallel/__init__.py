"""Several devices: `PipelineModel` splits a model into stages, one per device,
with micro-batch pipelining (GPipe's schedule, deferred weight gradients);
`balance` cuts layers into stages of near-equal cost; `launch` starts local
MultiWorkerMirroredStrategy workers (the `kvram launch` command)."""

from kvram.parallel._balance import Balance, balance
from kvram.parallel._launch import launch
from kvram.parallel._pipeline import PipelineModel

__all__ = ["PipelineModel", "balance", "Balance", "launch"]
