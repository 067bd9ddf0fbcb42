"""benchmarks/common.py's child runner, on made-up children (plain Python, no TensorFlow)."""

import sys

from benchmarks.common import run_child, without_options


def test_run_child_reads_every_result_record_its_own_and_kvram_launchs_workers():
    script = ('import json\nprint("progress RESULT not a record")\nprint("RESULT " + json.dumps({"a": 1}))\n'
              'print("[worker 1] RESULT " + json.dumps({"worker": 1}))')
    records, error, _ = run_child([sys.executable, "-c", script])
    assert error is None and records == [{"a": 1}, {"worker": 1}]


def test_run_child_says_why_a_child_failed_or_printed_no_record():
    records, error, stderr = run_child([sys.executable, "-c", "import sys; sys.exit('went wrong')"])
    assert records == [] and "went wrong" in error and "went wrong" in stderr
    records, error, _ = run_child([sys.executable, "-c", "print('no record')"])
    assert records == [] and error == "no record\n"
    records, error, _ = run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert records == [] and error == "timed out after 0.5 s"


def test_without_options_drops_the_options_and_their_values():
    assert without_options(["--out", "x.json", "--steps", "3", "--only=a", "--only", "b"], ("--out", "--only")) == [
        "--steps", "3"]


def test_run_children_hands_the_results_so_far_to_each_after_every_child(tmp_path):
    from benchmarks.common import run_children

    script = tmp_path / "suite.py"
    script.write_text('import json, sys\nname = sys.argv[2]\nif name == "bad":\n    sys.exit("bad child")\n'
                      'print("RESULT " + json.dumps({"name": name, "n": int(sys.argv[3])}))\n')
    seen = []
    results = run_children(str(script), ["a", "bad", "b"], [7], lambda r: r["name"],
                           each=lambda so_far: seen.append(sorted(so_far)))
    assert seen == [["a"], ["a", "bad"], ["a", "b", "bad"]]
    assert results["a"]["n"] == 7 and results["b"]["name"] == "b" and "bad child" in results["bad"]["error"]
