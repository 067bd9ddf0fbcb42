"""Writes the tables of docs/benchmarks.md, README.md's headline table, the data guide's
readers and the training guide's host-offload runs from the committed results (benchmarks/results/<suite>_<machine>.json), and the
memory-against-speed picture. A number in the docs is the number in a result file:
tests/test_report.py renders the pages and fails where the committed ones differ.

    python -m benchmarks.report            # write the pages and the picture
    python -m benchmarks.report --check    # exit 1 where a committed page differs from its rendering
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
README = os.path.join(ROOT, "README.md")
DATA_GUIDE = os.path.join(ROOT, "docs", "guides", "data.md")
TRAINING_GUIDE = os.path.join(ROOT, "docs", "guides", "training.md")
PICTURE = os.path.join(ROOT, "docs", "img", "memory_vs_speed.png")
# README.md's and the data guide's generated parts lie between these lines
BEGIN, END = "<!-- benchmarks.report: begin -->", "<!-- benchmarks.report: end -->"

# The suites of the headline table: (title, result file, PyTorch's torch.compile configuration,
# {role in README's table: configuration}); a role a suite's result does not hold is left out
SUITES = (
    ("ResNet50, batch 256", "resnet50_h200.json", "torch_fp16_compile",
     {"plain": "keras_fp16", "fastest": "kvram_fast", "leanest": "kvram_lean"}),
    ("ViT-B/16, batch 256", "vit_h200.json", "torch_fp16_compile",
     {"plain": "keras_bf16", "fastest": "kvram_fast", "leanest": "kvram_lean"}),
    ("Llama 1.2B, 4 x 2048 tokens", "decoder_llama_h200.json", "torch_compile",
     {"plain": "keras_bf16", "checkpointed": "torch_compile_ckpt", "fastest": "kvram_fast", "leanest": "kvram_lean"}),
    ("GPT-2-medium, 8 x 1024 tokens", "decoder_gpt2_h200.json", "torch_compile",
     {"plain": "keras_bf16", "checkpointed": "torch_compile_ckpt", "fastest": "kvram_fast"}),
)
ROLES = (("plain", "plain Keras"), ("peer", "PyTorch `torch.compile`"),
         ("checkpointed", "PyTorch `torch.compile`, checkpointed"), ("fastest", "kvram, fastest"),
         ("leanest", "kvram, leanest"))
_UNITS = {"img_per_s": "img/s", "tokens_per_s": "tokens/s"}


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _ratio(value, peer) -> str:
    return f"{value / peer:.2f}x" if value is not None and peer else "-"


def _source(result: dict, name: str, link: str | None) -> str:
    """Where a result was measured, and its file (a link from README.md; the documentation
    site names it, as mkdocs links only within docs/)."""
    gpu = result["gpu"].split(",")[0].removeprefix("NVIDIA ")
    commit = (result.get("commit") or "?")[:7]
    where = f"[`{name}`]({link}{name})" if link else f"`benchmarks/results/{name}`"
    return f"{gpu}, {result['date']}, commit {commit}, {where}"


def suite_table(title: str, name: str, peer: str, link: str | None = None) -> list[str]:
    """The lines of one suite's table: every configuration of its result."""
    result = load(name)
    rate, runs = result["rate"], result["results"]
    peer_run = runs.get(peer, {})
    mfu = any("mfu" in run for run in runs.values())
    lines = [f"### {title}", "", f"Measured on {_source(result, name, link)}, `{result['command']}`"
             f" ({result['steps']} timed steps after {result['warmup']})."
             + (f" {result['note'][0].upper()}{result['note'][1:]}." if result.get("note") else ""), "",
             f"| configuration | {_UNITS[rate]} | peak GiB | speed vs `torch.compile` | memory vs `torch.compile` |"
             + (" MFU |" if mfu else ""),
             "|---|---:|---:|---:|---:|" + ("---:|" if mfu else "")]
    for config, run in runs.items():
        if "error" in run:
            lines.append(f"| `{config}` | failed | | | |" + (" |" if mfu else ""))
            continue
        cells = [f"{run['label']} (`{config}`)", f"{run[rate]:,.0f}", f"{run['peak_gib']:.2f}",
                 _ratio(run[rate], peer_run.get(rate)), _ratio(run["peak_gib"], peer_run.get("peak_gib"))]
        if mfu:
            cells.append(f"{100 * run['mfu']:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def page() -> str:
    """docs/benchmarks.md."""
    lines = [
        "# Benchmarks",
        "",
        "Each table is one run of one suite on one GPU: every configuration in its own process, PyTorch in the",
        "same run. Throughput is over the timed steps after warm-up (compilation excluded); the peak is the",
        "framework allocator's during them (weights, gradients and optimizer state included). This page is",
        "written by `python -m benchmarks.report` from the result files; each suite's folder under",
        "`benchmarks/` says how to run it.",
        "",
        "![Peak memory against speed, each relative to torch.compile](img/memory_vs_speed.png)",
        "",
    ]
    for title, name, peer, _ in SUITES:
        lines += suite_table(title, name, peer)
    return "\n".join(lines).rstrip() + "\n"


def headline() -> str:
    """README.md's table: for each suite, plain Keras, torch.compile and kvram's fastest and
    leanest configurations."""
    lines = ["| model | configuration | throughput | peak GiB | vs `torch.compile` (speed, memory) | MFU |",
             "|---|---|---:|---:|---|---:|"]
    sources = []
    for title, name, peer, roles in SUITES:
        result = load(name)
        rate, runs = result["rate"], result["results"]
        peer_run = runs[peer]
        for role, label in ROLES:
            config = peer if role == "peer" else roles.get(role)
            if config is None:
                continue
            run = runs[config]
            versus = "" if config == peer else (
                f"{_ratio(run[rate], peer_run[rate])}, {_ratio(run['peak_gib'], peer_run['peak_gib'])}")
            mfu = f"{100 * run['mfu']:.1f}%" if run.get("mfu") is not None else ""
            lines.append(f"| {title} | {label} (`{config}`) | {run[rate]:,.0f} {_UNITS[rate]} | "
                         f"{run['peak_gib']:.2f} | {versus} | {mfu} |")
        sources.append(f"- {title}: {_source(result, name, 'benchmarks/results/')}: `{result['command']}`")
    return "\n".join([BEGIN, *lines, "", *sources, END]) + "\n"


# the data guide's readers: (configuration of benchmarks/data/bench.py io, what it is)
READERS = (
    ("raw_memmap_copy", "numpy copy straight from the memmap"),
    ("kvram", "`to_tf_dataset`, first epoch (checksums checked)"),
    ("kvram_unverified", "`to_tf_dataset`, unchecked"),
    ("kvram_shuffled", "`to_tf_dataset(shuffle=True)`, first epoch"),
    ("kvram_unverified_view", "`to_tf_dataset(read=\"view\")`, unchecked"),
    ("from_generator", "`tf.data.Dataset.from_generator` over the same memmap"),
    ("from_tensor_slices", "`from_tensor_slices` of the arrays read into memory (reading and building it counted)"),
)


def readers(name: str = "data_io_cpu.json") -> str:
    """The data guide's table: `benchmarks/data/bench.py io`'s readers against the raw copy."""
    result = load(name)
    runs = result["results"]
    cpu = f"{result['cpu_cores']} cores" + (" with AVX-512" if result["avx512"] else "")
    lines = [f"Reading {result['bytes'] / 2**30:g} GiB of {result['row_bytes'] // 1024} KiB rows from the page "
             f"cache, batch {result['batch']}, each method's median of {result['repeat']} rounds, every batch "
             f"copied once into the same buffer ({cpu}, {result['date']}, commit {result['commit'][:7]}, "
             f"`{result['command']}`, `benchmarks/results/{name}`):",
             "", "| reader | GB/s | of the raw memmap copy |", "|---|---:|---:|"]
    lines += [f"| {label} | {runs[config]['gb_per_s']:.2f} | {runs[config]['fraction_of_raw']:.2f} |"
              for config, label in READERS]
    lines += ["", f"The first epoch's check cost {100 * runs['kvram']['verify_cost']:.0f}% of the bandwidth in "
              f"order and {100 * runs['kvram_shuffled']['verify_cost']:.0f}% shuffled. A `tf.data` pipeline that "
              f"reads nothing reaches {runs['tf_data_floor']['gb_per_s']:.2f} GB/s through the same loop: the "
              "most any `tf.data` reader reaches here."]
    return "\n".join([BEGIN, *lines, END]) + "\n"


# the training guide's host-offload runs: results of benchmarks/optimizers/capacity.py (a file is
# one report, or holds reports), newest first
OFFLOAD = ("optimizers_offload_8b_32rows_h100.json", "optimizers_offload_8b_h100.json",
           "optimizers_offload_update_gpu_8b_width_h100.json", "optimizers_offload_parity_1b_h100.json",
           "optimizers_offload_update_gpu_1b_h100.json", "optimizers_offload_updates_h200.json")


def _reports(result: dict) -> list[dict]:
    return [result] if "runs" in result else [v for v in result.values() if isinstance(v, dict) and "runs" in v]


def _recipe(config: str, s: dict) -> str:
    """How a capacity.py run trained, from its settings."""
    if config == "kvram_gpu":
        return f"on the device: `AdamW8bit`, `mixed_bfloat16`, {s['accumulation']} accumulated batches of {s['batch']}"
    parts = ([f"{s['batch']} rows in {s['row_chunks']} slices"] if s.get("row_chunks") else []) + (
        [f"{s['accumulation']} accumulated batches of {s['batch']}"] if s["accumulation"] > 1 else [])
    if s.get("host_groups", 1) > 1:
        parts.append(f"`groups={s['host_groups']}`")
    if s.get("update_device") == "gpu":
        parts.append("update on the GPU")
    if s.get("block_inputs") == "host":
        parts.append('`block_inputs="host"`')
    if s.get("head_chunk", 1024) != 1024:
        parts.append(f"head chunk {s['head_chunk']}")
    return "host update, " + ", ".join(parts or [f"batch {s['batch']}"])


def _outcome(run: dict) -> list[str]:
    """tokens/s, MFU, GPU and host peaks, loss: the cells of a run (what stopped it, if it did not train)."""
    if not run.get("trained"):
        error = run.get("error", "")
        why = ("out of GPU memory" if "RESOURCE_EXHAUSTED" in run.get("error_tail", error) else
               error if error.startswith("timed out") else (error.splitlines() or ["did not train"])[0][:60])
        return [why, "", "", "", ""]
    return [f"{run['tokens_per_s']:,.0f}", f"{100 * run['mfu']:.1f}%", f"{run['peak_gib']:.2f}",
            f"{run['host_peak_gib']:.1f}", f"{run['final_loss']:.4f}"]


def offload() -> str:
    """The training guide's table of host-offloaded runs (and their on-device twins)."""
    lines = ["Llama-shaped KerasHub models, sequence 2048, every weight trainable, `AdamW8bit`, a `Checkpoint` on",
             "every block, the GPU capped at 24 GiB; each row's command is in its result file.", "",
             "| parameters (depth, hidden, vocabulary) | recipe | tokens per update | tokens/s | MFU | GPU peak GiB "
             "| host peak GiB | mean loss, timed steps | measured |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    twins = []
    for name in OFFLOAD:
        result = load(name)
        for report in _reports(result):
            s = report["settings"]
            for run in report["runs"]:
                size = f"{run['parameters'] / 1e9:.2f} B " if run.get("parameters") else ""
                model = f"{size}({run['depth']}, {s['hidden']}, {s['vocabulary']})"
                tokens = s["batch"] * s["accumulation"] * s["sequence"]
                where = (f"{report['gpu'].split(',')[0].removeprefix('NVIDIA ')}, {report['date']}, commit "
                         f"{report['commit'][:7]}, `{name}`")
                cells = [model, _recipe(run["config"], s), f"{tokens:,}", *_outcome(run), where]
                lines.append("| " + " | ".join(cells) + " |")
            twins += _twins(report, name)
    return "\n".join([BEGIN, *lines, *(["", *twins] if twins else []), END]) + "\n"


# torch.testing.assert_close's defaults for bfloat16: |actual - expected| <= atol + rtol * |expected|
BF16_RTOL, BF16_ATOL = 0.016, 1e-5


def _twins(report: dict, name: str) -> list[str]:
    """A sentence per depth at which a report holds a host-offloaded run and its on-device twin, both
    trained: their losses, and whether the host's is within bfloat16's tolerance of the device's."""
    trained = {(r["config"], r["depth"]): r for r in report["runs"] if r.get("trained")}
    lines = []
    for (config, depth), device in trained.items():
        host = trained.get(("kvram_offload", depth))
        if config != "kvram_gpu" or host is None:
            continue
        last = "last_loss" in device and "last_loss" in host
        key = "last_loss" if last else "final_loss"
        a, b = device[key], host[key]
        within = abs(b - a) <= BF16_ATOL + BF16_RTOL * abs(a)
        per, each = device.get("batches_per_update", 1), device.get("last_loss_steps", 1)
        n = device["warmup_steps"] + device["timed_steps"] if last else device["timed_steps"]
        unit = "batches" if per > 1 else "steps"
        notes = [f"{n // per} updates"] if per > 1 else []
        notes.append("warm-up included" if last else "the last one's alone was not recorded")
        what = ((f"the loss of the last of {n} {unit}" if each == 1 else
                 f"the mean loss of the last {each} of {n} {unit}") if last else
                f"the mean loss over the {n} timed {unit}") + f" ({'; '.join(notes)})"
        lines.append(f"In `{name}`, the host-offloaded run at depth {depth} and its on-device twin: {what} is "
                     f"{b:.4f} and {a:.4f}, {abs(b - a) / abs(a):.1%} apart: "
                     f"{'within' if within else 'outside'} bfloat16's tolerance (`torch.testing.assert_close`'s "
                     f"for bfloat16: {BF16_ATOL:g} + {BF16_RTOL:g} x |on-device loss|).")
    return lines


def _rendered(text: str, part: str) -> str:
    """`text` with its generated part (between BEGIN and END) replaced by `part`."""
    start, end = text.index(BEGIN), text.index(END) + len(END) + 1
    return text[:start] + part + text[end:]


def readme(text: str) -> str:
    """`text` (README.md) with its generated part rendered again."""
    return _rendered(text, headline())


def data_guide(text: str) -> str:
    """`text` (docs/guides/data.md) with its table of readers rendered again."""
    return _rendered(text, readers())


def training_guide(text: str) -> str:
    """`text` (docs/guides/training.md) with its table of host-offloaded runs rendered again."""
    return _rendered(text, offload())


def picture(path: str = PICTURE) -> None:
    """Peak memory against speed, each relative to torch.compile, one panel per suite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(SUITES), figsize=(4 * len(SUITES), 3.6))
    for axis, (title, name, peer, _) in zip(axes, SUITES):
        result = load(name)
        rate, runs = result["rate"], result["results"]
        for config, run in runs.items():
            if "error" in run:
                continue
            x, y = run["peak_gib"] / runs[peer]["peak_gib"], run[rate] / runs[peer][rate]
            colour = "tab:orange" if run["framework"] == "torch" else (
                "tab:gray" if run["settings"].get("plain") else "tab:blue")
            axis.scatter([x], [y], color=colour)
            axis.annotate(config, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axis.set_title(title.split(",")[0], fontsize=9)
        axis.set_xlabel("peak memory / torch.compile's")
        axis.axhline(1.0, color="lightgray", lw=0.8)
        axis.axvline(1.0, color="lightgray", lw=0.8)
    axes[0].set_ylabel("speed / torch.compile's")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 where a page differs")
    args = parser.parse_args(argv)
    committed = {}
    for path in (README, PAGE, DATA_GUIDE, TRAINING_GUIDE):
        with open(path) as f:
            committed[path] = f.read()
    wanted = {README: readme(committed[README]), PAGE: page(), DATA_GUIDE: data_guide(committed[DATA_GUIDE]),
              TRAINING_GUIDE: training_guide(committed[TRAINING_GUIDE])}
    stale = [path for path, text in wanted.items() if text != committed[path]]
    if args.check:
        for path in stale:
            print(f"{os.path.relpath(path, ROOT)} differs from its rendering: run python -m benchmarks.report",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in wanted.items():
        with open(path, "w") as f:
            f.write(text)
    picture()
    return 0


if __name__ == "__main__":
    sys.exit(main())
