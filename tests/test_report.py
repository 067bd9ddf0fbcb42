"""The tables of README.md, docs/benchmarks.md and the data and training guides are the committed results'
numbers: `python -m benchmarks.report` renders them from benchmarks/results/, and the committed
pages must equal the rendering (benchmarks/report.py)."""

import os
import re

import pytest

from benchmarks import report


def test_the_benchmarks_page_is_rendered_from_the_results():
    with open(report.PAGE) as f:
        assert f.read() == report.page(), "run python -m benchmarks.report"


def test_the_readme_headline_table_is_rendered_from_the_results():
    with open(report.README) as f:
        text = f.read()
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert text == report.readme(text), "run python -m benchmarks.report"


@pytest.mark.parametrize("path,render,row", [
    (report.DATA_GUIDE, report.data_guide, "| `to_tf_dataset`, first epoch (checksums checked) |"),
    (report.TRAINING_GUIDE, report.training_guide, "| 8.03 B (32, 4096, 128256) | host update, 8 rows in 8 slices,"),
], ids=["data", "training"])
def test_a_guides_table_is_rendered_from_the_results(path, render, row):
    with open(path) as f:
        text = f.read()
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert text == render(text), "run python -m benchmarks.report"
    assert row in text


def test_every_row_of_the_headline_names_a_configuration_of_its_result():
    for title, name, peer, roles in report.SUITES:
        result = report.load(name)
        assert {peer, *roles.values()} <= set(result["results"]), (name, sorted(result["results"]))
        assert result["date"] and result["commit"] and result["gpu"] and result["command"]
        assert all("error" not in result["results"][c] for c in (peer, *roles.values())), name


def test_every_result_file_the_readme_and_docs_cite_exists():
    root = report.ROOT
    cited = set()
    for folder, _, files in [(root, None, ["README.md"])] + list(os.walk(os.path.join(root, "docs"))):
        for name in files:
            if name.endswith(".md"):
                with open(os.path.join(folder, name)) as f:
                    cited |= set(re.findall(r"results/([A-Za-z0-9_.-]+\.json)", f.read()))
    assert cited, "the pages cite no result"
    missing = sorted(n for n in cited if not os.path.exists(os.path.join(report.RESULTS, n)))
    assert missing == []


def test_a_host_offloaded_run_and_its_twin_are_compared_at_bfloat16s_tolerance():
    from benchmarks.report import _twins

    def run(config, loss, **more):
        return {"config": config, "depth": 2, "trained": True, "last_loss": loss, "final_loss": 9.0,
                "warmup_steps": 1, "timed_steps": 200, **more}

    def sentence(host, device=1.0, **more):
        return _twins({"runs": [run("kvram_gpu", device, **more), run("kvram_offload", host)]}, "r.json")

    # torch.testing.assert_close's bfloat16 bar: 1e-5 + 0.016 x 1.0 apart at the most
    assert "the loss of the last of 201 steps" in sentence(1.0159)[0] and "within" in sentence(1.0159)[0]
    assert "outside" in sentence(1.0161)[0] and "1.6% apart" in sentence(1.0161)[0]
    assert "last of 201 batches (25 updates; warm-up included)" in sentence(1.0, batches_per_update=8)[0]
    assert "the mean loss of the last 4 of 201 steps" in sentence(1.0, last_loss_steps=4)[0]
    without_last = {"runs": [{**run("kvram_gpu", 0), "final_loss": 1.0}, {**run("kvram_offload", 0), "final_loss": 1.2}]}
    for r in without_last["runs"]:
        del r["last_loss"]
    assert "mean loss over the 200 timed steps" in _twins(without_last, "r.json")[0]
    assert _twins({"runs": [run("kvram_gpu", 1.0), run("kvram_offload", 1.0, trained=False)]}, "r.json") == []
