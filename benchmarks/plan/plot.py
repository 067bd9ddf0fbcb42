"""Peak memory vs img/s of ResNet50 at batch 256 on an H200 (issue 12): every
configuration `kvram plan` tried (benchmarks/results/plan_h200/), plain Keras,
and PyTorch with and without `checkpoint_sequential` from the ResNet50 speed
benchmark (benchmarks/results/resnet50_pinned_h200.json, part B: another run and
harness on the same GPU model and batch, so those points are context, not a
same-run ratio).

    python benchmarks/plan/plot.py   # writes benchmarks/results/plan_h200/resnet50_memory_vs_speed.png
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")
GIB = 2**30


def points():
    kvram, keras_points = [], []
    for cap in ("16", "48"):
        with open(os.path.join(RESULTS, "plan_h200", f"plan_resnet50_{cap}.json")) as f:
            run = json.load(f)
        rec, plain = run["recommended"], run["recommended"]["plain"]
        kvram.append((rec["peak_bytes"] / GIB, rec["samples_per_second"], f"recommended, {cap} GiB cap"))
        keras_points.append((plain["peak_bytes"] / GIB, plain["samples_per_second"], f"bf16, {cap} GiB cap"))
        if run.get("plain_float32", {}).get("peak_bytes"):
            p = run["plain_float32"]
            keras_points.append((p["peak_bytes"] / GIB, p["samples_per_second"], "float32"))
        for t in run.get("tried", []):
            if t.get("peak_bytes"):
                slices = f"{t['micro_batch_size']}-row slices" if t["micro_batch_size"] else "whole batch"
                kvram.append((t["peak_bytes"] / GIB, t["samples_per_second"], f"{t['remat']}, {slices}"))
    with open(os.path.join(RESULTS, "resnet50_pinned_h200.json")) as f:
        part = json.load(f)["parts"]["B"]["results"]
    torch = [(part[k]["peak_gib"], part[k]["img_per_s"], label)
             for k, label in (("torch_fp16", "fp16"), ("torch_fp16_ckpt4_inplace", "fp16, checkpoint_sequential(4)"))]
    return kvram, keras_points, torch


def main() -> str:
    kvram, keras_points, torch = points()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for series, marker, name in ((kvram, "o", "kvram plan (mixed_bfloat16)"), (keras_points, "s", "plain Keras"),
                                 (torch, "^", "PyTorch (other run)")):
        ax.scatter([p[0] for p in series], [p[1] for p in series], marker=marker, s=50, label=name)
        for x, y, label in series:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    for cap in (16, 48):
        ax.axvline(cap, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("training images/s")
    ax.set_title("ResNet50, batch 256, H200: memory vs speed")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    out = os.path.join(RESULTS, "plan_h200", "resnet50_memory_vs_speed.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(main())
