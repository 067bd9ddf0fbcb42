import kvram


def test_public_names_import():
    for name in kvram.__all__:
        assert hasattr(kvram, name), name
    for module in (kvram.layers, kvram.memory, kvram.precision, kvram.callbacks, kvram.data, kvram.parallel,
                   kvram.remat, kvram.speed):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert callable(kvram.Model)
    assert callable(kvram.layers.Checkpoint)


def test_py_typed_shipped():
    import importlib.resources

    assert importlib.resources.files("kvram").joinpath("py.typed").is_file()
