"""Reading GPU kernel timelines (TensorFlow's XSpace, PyTorch's Chrome trace) and
sorting each kernel into a kind of work.

Both frameworks end up in the same record: a list of `(name, start_us, dur_us,
stream, op)` where `op` is the framework's own op name for the kernel where the
profiler knows it (TF: `tf_op`, or the XLA instruction `hlo_op`; PyTorch: the
enclosing aten op is not kept). `breakdown()` sums them by kind and measures how
long the GPU sat idle inside the profiled window (host gaps).
"""

from __future__ import annotations

import re

# Kinds, in the order they are tried. A kernel goes to the first kind whose
# pattern matches its name, or, for XLA fusions and TF ops whose kernel names
# say nothing, its op name (see `kind_of`).
KINDS = (
    ("conv_backward_filter", r"wgrad|bwd_filter|backward_filter|convolve_dw|conv2d_grad_filter|BackpropFilter"),
    ("conv_backward_data", r"dgrad|bwd_data|backward_data|convolve_dx|conv2d_grad_input|BackpropInput"),
    ("conv_forward", r"fprop|fwd_|implicit_convolve|conv2d_c1_k1|winograd|convolve_sgemm|cudnn.*conv|Conv2D"),
    ("matmul", r"gemm|cublas|cutlass|matmul|MatMul|nvjet"),
    ("layout_transpose", r"nchwToNhwc|nhwcToNchw|[Tt]ranspose|SwapDimension|permute|copy_.*channels"),
    ("batch_norm", r"bn_fw|bn_bw|batch_norm|batchnorm|BatchNorm|bn_.*kernel|welford|cudnn::bn"),
    ("pooling", r"pool|Pool"),
    ("memcpy_h2d", r"Memcpy ?HtoD|MemcpyH2D|Memcpy HtoD"),
    ("memcpy_d2h", r"Memcpy ?DtoH|MemcpyD2H|Memcpy DtoH"),
    ("memcpy_d2d", r"Memcpy ?DtoD|MemcpyD2D|Memcpy DtoD|Memset|memset|Memcpy"),
)

# For kernels whose names say little (XLA's `loop_fusion_12`, Eigen's
# element-wise kernels), the op they belong to decides.
OP_KINDS = (
    ("loss_scaling", r"LossScale|loss_scale|all_finite|is_finite|IsFinite|non_finite|unscale|_amp_"),
    ("optimizer_update", r"SGD|sgd|[Mm]omentum|[Aa]dam|optimizer|ResourceApply|multi_tensor_apply|AssignAdd|AssignSub"),
    ("batch_norm", r"_bn/|_bn$|batch_normalization|BatchNorm|batchnorm|moments|FusedBatchNorm|native_batch_norm|/bn\d"),
    ("conv_backward_filter", r"Conv2DBackpropFilter|convolution_backward.*weight"),
    ("conv_backward_data", r"Conv2DBackpropInput"),
    ("conv_forward", r"Conv2D|cudnn-conv|convolution"),
    ("layout_transpose", r"[Tt]ranspose"),
    ("pooling", r"[Pp]ool"),
    ("loss", r"[Ss]oftmax|cross_?entropy|[Ll]oss|log_softmax|nll"),
)

_NAME_RULES = [(kind, re.compile(pattern)) for kind, pattern in KINDS]
_OP_RULES = [(kind, re.compile(pattern)) for kind, pattern in OP_KINDS]
_REDUCTION = re.compile(r"reduce|reduction|Reduce|Sum|Mean|Max|welford")


def kind_of(name: str, op: str = "") -> str:
    """The kind of work of one kernel, from its name and (when known) its op."""
    for kind, rule in _NAME_RULES:
        if rule.search(name):
            return kind
    for kind, rule in _OP_RULES:
        if op and rule.search(op):
            return kind
    if _REDUCTION.search(name):
        return "reduction_other"
    return "elementwise_other"


def union_seconds(intervals) -> float:
    """Length of the union of `(start, end)` intervals."""
    total, end_so_far = 0.0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total


def _window(intervals) -> float:
    """From the first start to the last end of `(start, end)` intervals (0 if none)."""
    return max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0


def gaps(kernels, steps: int, largest: int = 12) -> dict:
    """Where the GPU sat idle between kernels (any stream), per step: the idle
    time in gaps under 50 us (launch after launch), 50 us to 1 ms, and 1 ms or
    more (the host, or a copy, held the GPU up), and the `largest` gaps with
    the kernels either side."""
    found = _idle(kernels)
    bands = {"under_50us": (0, 50), "50us_to_1ms": (50, 1000), "1ms_or_more": (1000, float("inf"))}
    return {
        "steps": steps,
        "idle_ms_per_step": {band: sum(g for g, *_ in found if low <= g < high) / steps / 1e3
                             for band, (low, high) in bands.items()},
        "gaps_per_step": {band: sum(1 for g, *_ in found if low <= g < high) / steps
                          for band, (low, high) in bands.items()},
        "largest": [{"ms": round(g / 1e3, 3), "after": a[:80], "before": b[:80]}
                    for g, a, b, _start in sorted(found, key=lambda item: -item[0])[:largest]],
    }


def _idle(kernels):
    """[(gap_us, kernel before, kernel after, gap start_us)] of every stretch
    when no kernel or copy ran; memcpys named with their op ("MemcpyD2H [op]")."""
    ordered = sorted(kernels, key=lambda record: record[1])
    found, end, before = [], None, None
    for name, start, dur, _stream, op in ordered:
        label = f"{name} [{op}]" if name.startswith("Memcpy") and op else name
        if end is not None and start > end:
            found.append((start - end, before, label, end))
        if end is None or start + dur > end:
            end, before = start + dur, label
    return found


def breakdown(kernels, steps: int) -> dict:
    """Per-step milliseconds by kind, kernel counts, GPU busy time and idle gaps.

    `kernels`: `(name, start_us, dur_us, stream, op)` records covering `steps`
    training steps. Kernels overlapping on several streams are each counted in
    their kind (so kinds may add up to more than the busy time); `busy_ms` is the
    union, and `idle_ms` the time inside the window when no kernel ran (launch
    latency, host work, synchronisation). `streams` holds the same for compute
    kernels alone (copies left out): `compute_idle_ms_per_step` is the time the
    computation waited, for the host or for its input, and `h2d_ms_per_step` the
    host-to-GPU copy time.
    """
    by_kind: dict[str, list] = {}
    by_name: dict[str, list] = {}
    intervals, compute, h2d = [], [], []
    for name, start, dur, _stream, op in kernels:
        kind = kind_of(name, op)
        entry = by_kind.setdefault(kind, [0.0, 0])
        entry[0] += dur
        entry[1] += 1
        key = by_name.setdefault(name, [0.0, 0, kind, op])
        key[0] += dur
        key[1] += 1
        intervals.append((start, start + dur))
        if kind == "memcpy_h2d":
            h2d.append(intervals[-1])
        elif not kind.startswith("memcpy"):
            compute.append(intervals[-1])
    if not intervals:
        return {"kernels": 0}
    window = _window(intervals)
    busy = union_seconds(intervals)
    compute_busy = union_seconds(compute)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:60]
    return {
        "steps": steps,
        "kernels_per_step": len(intervals) / steps,
        "window_ms_per_step": window / steps / 1e3,
        "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (window - busy) / steps / 1e3,
        "kinds_ms_per_step": {
            k: round(v[0] / steps / 1e3, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])
        },
        "kinds_kernels_per_step": {k: v[1] / steps for k, v in by_kind.items()},
        "streams": {
            "compute_busy_ms_per_step": compute_busy / steps / 1e3,
            "compute_window_ms_per_step": _window(compute) / steps / 1e3,
            "compute_idle_ms_per_step": (_window(compute) - compute_busy) / steps / 1e3,
            "h2d_ms_per_step": union_seconds(h2d) / steps / 1e3,
        },
        "top_kernels": [
            {"name": n[:200], "op": v[3][:200], "kind": v[2], "ms_per_step": v[0] / steps / 1e3,
             "calls_per_step": v[1] / steps}
            for n, v in top
        ],
    }


def read_xspace(path: str):
    """A TensorFlow profiler `*.xplane.pb` file, parsed (for `xspace_kernels`)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def xspace_kernels(space):
    """Kernel and memcpy records from a parsed TensorFlow profile (`read_xspace`)."""
    records = []
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # derived lines (XLA Ops, TensorFlow Ops, Steps) repeat the streams
            for event in line.events:
                meta = plane.event_metadata[event.metadata_id]
                op = ""
                for stat in list(event.stats) + list(meta.stats):
                    stat_name = stat_names.get(stat.metadata_id, "")
                    if stat_name in ("tf_op", "hlo_op", "level 0"):
                        value = stat.str_value or (
                            plane.stat_metadata[stat.ref_value].name if stat.ref_value else ""
                        )
                        if value and (not op or stat_name == "hlo_op"):
                            op = value
                start_us = line.timestamp_ns / 1e3 + event.offset_ps / 1e6
                records.append((meta.name or meta.display_name, start_us, event.duration_ps / 1e6,
                                line.name, op))
    return records


def chrome_trace_kernels(path: str):
    """Kernel and memcpy records from PyTorch's `export_chrome_trace` JSON (gzip or not)."""
    import gzip
    import json

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    records = []
    for event in trace.get("traceEvents", []):
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in event:
            records.append((event["name"], float(event["ts"]), float(event["dur"]),
                            str(event.get("tid")), ""))
    return records


# A transformer step's work by part of the model, for XLA kernels from the op
# name of their HLO instruction (the Keras layer path, `op_names`), for
# PyTorch's from the kernel's name (Inductor names its Triton kernels after the
# aten ops they fuse; cuBLAS and flash-attention kernels name themselves).
# Tried in order; a kernel's GEMM-ness comes from `KINDS` (`matmul`).
PARTS = (
    ("optimizer", r"(?i)adam|optimizer|multi_tensor|apply_gradients|non_finite|unscale|_amp_|loss_scale"),
    ("loss", r"(?i)cross_?entropy|log_softmax|nll_loss|sparse_categorical|/loss/|^loss"),
    ("layer_norm", r"(?i)layer_?norm|_ln\d|final_ln"),
    ("attention", r"(?i)attention|softmax|flash|fmha|sdpa|scaled_dot|_attn"),
    ("mlp", r"(?i)_mlp\d|gelu|erf|feedforward"),
    ("patch_embedding", r"(?i)patch|class_and_position|convolution|conv2d|embedding"),
    ("head", r"(?i)/head/|class_token|lm_head"),
    ("residual_add", r"(?i)_add\d"),
)
_PART_RULES = [(part, re.compile(pattern)) for part, pattern in PARTS]


def part_of(name: str, op: str = "", op_names=None) -> str:
    """`part/gemm` or `part/other` for one kernel: the part of the model from
    its XLA instruction's op name (`op_names`: instruction -> op name) or else
    its own name; `unattributed` where neither says."""
    gemm = kind_of(name) == "matmul" or "gemm" in op or "cublas" in op
    text = (op_names or {}).get(op) or name
    for part, rule in _PART_RULES:
        if rule.search(text):
            return f"{part}/{'gemm' if gemm else 'other'}"
    return f"unattributed/{'gemm' if gemm else 'other'}"


def by_part(kernels, steps: int, op_names=None) -> dict:
    """Per-step milliseconds of compute kernels (copies left out) by `part_of`."""
    sums: dict[str, float] = {}
    for name, _start, dur, _stream, op in kernels:
        if kind_of(name, op).startswith("memcpy"):
            continue
        part = part_of(name, op, op_names)
        sums[part] = sums.get(part, 0.0) + dur
    return {k: round(v / steps / 1e3, 3) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])}


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(.*?op_name=\"([^\"]*)\"")


def hlo_instructions(directory: str) -> dict:
    """{instruction name: (result shape, HLO opcode, TensorFlow op name)} of
    the largest optimized HLO module dumped under `directory` (`--xla_dump_to`,
    `--xla_dump_hlo_as_text`): what a fused kernel named after its instruction
    (`input_reduce_fusion.138`) computes."""
    import glob
    import os

    modules = glob.glob(os.path.join(directory, "*after_optimizations.txt"))
    if not modules:
        return {}
    found = {}
    with open(max(modules, key=os.path.getsize)) as f:
        for line in f:
            match = _INSTRUCTION.match(line)
            if match:
                found[match.group(1)] = match.group(2, 3, 4)
    return found


def op_names(instructions: dict) -> dict:
    """{instruction name: TensorFlow op name} of `hlo_instructions`' result."""
    return {name: op_name for name, (_, _, op_name) in instructions.items()}


def describe_top_kernels(profile: dict, instructions: dict) -> None:
    """Adds to each of `breakdown`'s top kernels the result shape, opcode and
    TensorFlow op name of its HLO instruction, where the dump has it."""
    for kernel in profile.get("top_kernels", []):
        found = instructions.get(kernel["op"])
        if found:
            kernel["hlo_shape"], kernel["hlo_opcode"], kernel["tf_op"] = found[0][:200], found[1], found[2][:300]
