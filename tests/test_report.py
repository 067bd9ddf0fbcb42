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
