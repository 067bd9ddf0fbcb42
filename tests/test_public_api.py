import importlib

import pytest

import kvram

# Every public name, from the path README and ARCHITECTURE.md give it.
DOCUMENTED = {
    "kvram": ["Model", "callbacks", "data", "layers", "memory", "optimizers", "parallel", "precision", "remat", "speed",
              "__version__"],
    "kvram.layers": ["Checkpoint", "FusedBatchNormalization", "MemoryEfficientAttention"],
    "kvram.training": ["Model", "FunctionalModel"],
    "kvram.callbacks": ["AdaptiveBatchSize", "MemoryLogger", "find_max_batch_size", "BatchSizeSearch"],
    "kvram.data": ["write_shards", "write_image_shards", "decode_jpeg", "ShardedDataset", "ShardError",
                   "raise_shard_errors", "FORMAT", "VERSION"],
    "kvram.remat": ["Segment", "segments", "rebuild", "plan", "Plan", "estimate", "measure", "Estimate",
                    "Configuration", "parse_bytes"],
    "kvram.parallel": ["PipelineModel", "balance", "Balance", "launch"],
    "kvram.memory": ["peak_bytes", "current_bytes", "reset_peak", "limit_bytes", "track", "Tracked",
                     "MemoryMonitor", "is_out_of_memory"],
    "kvram.precision": ["enable", "current_policy", "auto_policy", "loss_scale", "check_model_policy"],
    "kvram.speed": ["efficient_attention", "fuse_batch_norm", "fused_cross_entropy", "lean_activations",
                    "pin_host_memory", "host_memory_pinned", "tensordot_einsum"],
    "kvram.optimizers": ["AdamW8bit", "HostOffload", "ShardedState"],
    "kvram.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_public_names_import_from_their_documented_paths(module):
    imported = importlib.import_module(module)
    for name in DOCUMENTED[module]:
        assert hasattr(imported, name), f"{module}.{name}"
    assert sorted(getattr(imported, "__all__", DOCUMENTED[module])) == sorted(DOCUMENTED[module]), module


def test_the_same_objects_everywhere():
    assert kvram.Model is kvram.training.Model
    assert kvram.remat.estimate.__module__ == "kvram.remat._estimate"
    assert callable(kvram.Model) and callable(kvram.layers.Checkpoint)


@pytest.mark.parametrize("name", ["estimate", "measure", "Estimate", "Configuration", "parse_bytes"])
def test_kvram_plan_still_gives_the_planners_names_and_warns(name):
    import kvram.plan

    with pytest.warns(DeprecationWarning, match=rf"kvram.plan.{name} is now kvram.remat.{name}"):
        assert getattr(kvram.plan, name) is getattr(kvram.remat, name)
    with pytest.warns(DeprecationWarning):
        from kvram.plan import parse_bytes  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvram.plan.nothing  # noqa: B018


def test_py_typed_shipped():
    import importlib.resources

    assert importlib.resources.files("kvram").joinpath("py.typed").is_file()
