"""The training step: `kvram.Model`, a Keras model whose step adds loss
scaling, gradient accumulation, micro-batching, clipping across replicas and a
guard against non-finite gradients. `_step` holds the step's parts, as
functions of the model; `_train_function` the function Keras's fit loop calls
where kvram slices batches or recovers from out-of-memory errors."""

from kvram.training._model import FunctionalModel, Model

__all__ = ["Model", "FunctionalModel"]
