"""Where an XLA-compiled step's memory goes: the buffers live at its peak.

`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"` writes, for every
compiled module, its buffer assignment (`*buffer-assignment.txt`: total bytes)
and its scheduled optimised HLO (`*after_optimizations.txt`). This takes the
module with the most bytes (the training step), walks each of its
non-fused computations (the entry; a while loop's body) in XLA's schedule,
keeping every value live from its instruction to its last use (through
bitcasts and tuple elements), and at the computation's highest point lists
the live values: size, XLA instruction, shape and the TensorFlow op that made
it; then sums them by dtype, by instruction kind and by Keras layer (the op
name's innermost layer, block numbers folded: `encoder_block*_mlp1`).
Parameters (weights, optimizer state, the batch) are counted apart.

    python benchmarks/profile/xla_buffers.py DIR --out buffers.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

def module_bytes(text: str) -> int:
    """The module's total allocation bytes ("Total bytes used: ...")."""
    match = re.search(r"Total bytes used:\s*(\d+)", text)
    return int(match.group(1)) if match else 0


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
# ops whose result is another value's buffer (or a tuple of them)
_ALIASES = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "after-all", "opt-barrier"}


def shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
        if dtype in _BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _BYTES[dtype]
    return total


def computations(hlo: str) -> dict:
    """{name: [instruction lines]} of the non-fused computations."""
    found, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(2), []
            continue
        if line.startswith("}") and name is not None:
            if "fused" not in name and "wrapped" not in name and not name.startswith(("region", "add", "max", "min")):
                found[name] = lines
            name = None
        elif name is not None:
            lines.append(line)
    return found


def live_at_peak(lines) -> dict:
    """The highest point of one scheduled computation and what is live there."""
    values, last_use, source, parameters = [], {}, {}, 0
    for i, line in enumerate(lines):
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, op, rest = match.groups()
        operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0]) or re.findall(
            r"(?:^|[,(]\s*)([a-z][\w.\-]*\.\d+)", rest.split(")")[0])
        for operand in operands:
            root = source.get(operand, operand)
            for r in (root if isinstance(root, tuple) else (root,)):
                last_use[r] = i
        if op == "parameter":
            parameters += shape_bytes(shape)
        if op in _ALIASES:
            roots = tuple(source.get(o, o) for o in operands)
            flat = tuple(x for r in roots for x in (r if isinstance(r, tuple) else (r,)))
            source[name] = flat if len(flat) != 1 else flat[0]
            if "ROOT" in line.split("=")[0]:
                for r in flat:
                    last_use[r] = len(lines)
            continue
        meta = re.search(r'op_name="([^"]*)"', line)
        values.append((i, name, shape.strip(), op, meta.group(1) if meta else "", shape_bytes(shape)))
        last_use.setdefault(name, i)
        if "ROOT" in line.split("=")[0]:
            last_use[name] = len(lines)
    events = collections.Counter()
    for i, name, _, _, _, size in values:
        events[i] += size
        events[last_use[name] + 1] -= size
    live, peak, at = 0, 0, 0
    for i in sorted(events):
        live += events[i]
        if live > peak:
            peak, at = live, i
    held = [
        {"bytes": size, "op_name": op_name, "label": op, "shape": shape.split("{")[0], "name": name}
        for i, name, shape, op, op_name, size in values if i <= at <= last_use[name]
    ]
    return {"peak_bytes": peak, "parameter_bytes": parameters, "live": held}


def layer_of(op_name: str) -> str:
    """The Keras layer an op came from, block numbers folded."""
    parts = [p for p in op_name.split("/") if p]
    # Keras names ops layer/.../op; keep the innermost layer name
    name = parts[-2] if len(parts) >= 2 else (parts[0] if parts else "?")
    name = re.sub(r"_\d+$", "", name)
    return re.sub(r"\d+", "*", name)


def summarise(directory: str, top: int = 40) -> dict:
    files = glob.glob(os.path.join(directory, "*buffer-assignment.txt"))
    if not files:
        return {"error": f"no *buffer-assignment.txt under {directory}"}
    texts = {f: open(f).read() for f in files}
    largest = max(texts, key=lambda f: module_bytes(texts[f]))
    hlo_file = largest.replace("-buffer-assignment.txt", ".txt")
    walked = {name: live_at_peak(lines) for name, lines in computations(open(hlo_file).read()).items()}
    highest = max(walked, key=lambda n: walked[n]["peak_bytes"])
    buffers = walked[highest]["live"]

    def by(key):
        sums = collections.Counter()
        for b in buffers:
            sums[key(b)] += b["bytes"]
        return {k: round(v / 2**30, 3) for k, v in sums.most_common(top)}

    return {
        "module": os.path.basename(largest),
        "total_bytes_used_gib": round(module_bytes(texts[largest]) / 2**30, 3),
        "computation": highest,
        "parameter_gib": round(walked[highest]["parameter_bytes"] / 2**30, 3),
        "live_at_peak": len(buffers),
        "live_at_peak_gib": round(sum(b["bytes"] for b in buffers) / 2**30, 3),
        "gib_by_dtype": by(lambda b: b["shape"].split("[")[0]),
        "gib_by_xla_label": by(lambda b: b["label"].split(".")[0].split(" ")[0]),
        "gib_by_layer": by(lambda b: layer_of(b["op_name"])),
        "largest": sorted(buffers, key=lambda b: -b["bytes"])[:top],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--out")
    args = parser.parse_args()
    report = summarise(args.directory)
    text = json.dumps(report, indent=2)
    print(text[:4000])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
