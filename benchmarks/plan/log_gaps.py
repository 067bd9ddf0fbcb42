"""Where a TensorFlow process's time went between its log lines: reads a
stderr log with TensorFlow's timestamped lines (`TF_CPP_MIN_LOG_LEVEL=0`,
`TF_CPP_VMODULE=...`) and the `MARK` lines of `check_first_runs.py`, and
prints, for each stretch between two marks, its length, its lines counted by
source file, and its longest silences with the line before and after each:

    python3 benchmarks/plan/log_gaps.py run.log [--top 12]

A silence is time the logged modules did not log: the work after the line
before it (or before the line after it) went unlogged.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re

# absl's format (TensorFlow 2.21): "I0000 00:00:1795884347.276714     854 service.cc:153] ...", epoch seconds
_ABSL = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:(\d+\.\d+)\s+\d+ (?P<file>[^:\s]+):\d+\] (?P<text>.*)")
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}): (?:MARK (?P<mark>.*)|\w (?P<file>[^:\s]+):\d+\] (?P<text>.*))")


def parse(path):
    """[(seconds since the first line, mark or None, source file or None, text)]"""
    lines, first = [], None
    with open(path, errors="replace") as f:
        for raw in f:
            m = _LINE.match(raw)
            if m:
                t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
                mark, source, text = m.group("mark"), m.group("file"), m.group("mark") or m.group("text")
            elif m := _ABSL.match(raw):
                t, mark, source, text = float(m.group(1)), None, m.group("file"), m.group("text")
            else:
                continue
            first = t if first is None else first
            lines.append((t - first, mark, (source or "").rsplit("/", 1)[-1] or None, (text or "").strip()))
    return lines


def stretches(lines):
    """[(mark, its lines)], the lines before the first mark under None."""
    out, current, name = [], [], None
    for line in lines:
        if line[1] is not None:
            out.append((name, current))
            current, name = [line], line[1]
        else:
            current.append(line)
    out.append((name, current))
    return [s for s in out if s[1]]


def report(lines, top):
    parts = stretches(lines)
    for i, (name, part) in enumerate(parts):
        # the silence up to the next mark is this stretch's too
        following = part + parts[i + 1][1][:1] if i + 1 < len(parts) else part
        span = following[-1][0] - part[0][0]
        print(f"== {name or '(before the first mark)'}: {span:.2f} s, {len(part)} lines, from {part[0][0]:.2f} s")
        files = collections.Counter(line[2] for line in part if line[2])
        if files:
            print("   lines by file: " + ", ".join(f"{f} {n}" for f, n in files.most_common(8)))
        gaps = sorted(((b[0] - a[0], a, b) for a, b in zip(following, following[1:])), key=lambda g: -g[0])[:top]
        for gap, a, b in gaps:
            if gap < 0.05:
                break
            print(f"   {gap:7.2f} s after [{a[0]:.2f}] {a[2] or 'MARK'}: {a[3][:150]}")
            print(f"             before [{b[0]:.2f}] {b[2] or 'MARK'}: {b[3][:150]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    report(parse(args.log), args.top)


if __name__ == "__main__":
    main()
