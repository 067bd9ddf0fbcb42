import json

from kvram import cli


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensorflow"] and report["keras"]
    assert "/device:CPU:0" in report["devices"]


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "tensorflow" in out and "devices" in out


def test_demo_small_runs_and_prints_table(capsys, tmp_path):
    path = tmp_path / "demo.json"
    code = cli.main(["demo", "--device", "CPU:0", "--epochs", "1", "--samples", "1024",
                     "--batch-size", "512", "--blocks", "4", "--width", "128", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "peak memory (MiB)" in out and "final loss" in out
    result = json.loads(path.read_text())
    # Same model, same data, same seeds, float32 on CPU: the same function is trained.
    assert abs(result["kvram"]["final_loss"] - result["plain"]["final_loss"]) < 1e-3
    assert result["kvram"]["peak_mib"] < result["plain"]["peak_mib"]


def test_demo_rejects_bad_numbers(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["demo", "--epochs", "0"])
    assert "must be >= 1" in capsys.readouterr().err
