"""The largest Llama-shaped model that trains on one GPU under a memory cap: Keras's AdamW against kvram's state options.

A KerasHub `LlamaBackbone` (hidden 2048, 32 query and 8 key/value heads, intermediate 8192,
vocabulary 32000, untied head: KerasHub's default) of `depth` blocks, every weight trainable,
`--sequence` tokens x `--batch` rows, every decoder block checkpointed (`remat.rebuild`),
bfloat16 compute under XLA:

- `keras_adamw`: Keras's `AdamW` under `mixed_bfloat16` (float32 weights, gradients and moments),
  without the XLA flags and host pinning `import kvram` sets (as plain Keras runs).
- `kvram_state`: `bfloat16` weights, kvram's `AdamW8bit` (8-bit moments, stochastic rounding),
  `kvram.Model(update_in_backward=True)` (without the non-finite guard's second backward pass unless
  `--skip-nonfinite 1`: Keras applies every step too), `efficient_attention`, `lean_activations`,
  `fused_cross_entropy`.
- `kvram_factored`: as `kvram_state`, with `AdamW8bit(factored=True)` (an 8-bit first moment and
  Adafactor's factored second moment: about 3 bytes per parameter with the weights).
- `kvram_offload`: as `kvram_state` with `host_offload=True` instead of `update_in_backward`
  (state and float32 master weights on the host, `--accumulation` batches per update; with
  `--row-chunks`, each block runs a step's `--batch` rows in that many slices, so a step of many
  rows makes, and sends to the host, each gradient once; with `--host-groups N`, the host updates
  N runs of weights one by one as their gradients arrive, without the non-finite guard unless
  `--skip-nonfinite 1`; with `--update-device gpu`, the update's arithmetic runs on the GPU,
  reading and writing the host's masters and state: `HostOffload(update_device=...)`).
- `kvram_gpu`: `kvram_offload`'s twin on the device (`mixed_bfloat16`, the same `AdamW8bit` and
  `--accumulation`): its loss after `--steps` is what the offloaded run's should equal.

A run that runs out of memory is recorded as such. How to run it: README.md.

    python benchmarks/optimizers/capacity.py --runs keras_adamw:2,kvram_state:2 --sequence 64 --hidden 256 \
        --intermediate 512 --heads 4 --kv-heads 2 --vocabulary 512 --steps 2 --warmup 1 --device CPU:0"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    HostMemoryWatch, cap_first_gpu, child_result, gpu_name, result_header, run_child, set_kvram_switches, stage_lines,
    versions, without_options, write_result,
)

CONFIGS = {
    "keras_adamw": "Keras AdamW, mixed_bfloat16 (float32 weights, gradients, moments), a Checkpoint on every block, "
                   "XLA's default flags (not kvram's)",
    "kvram_state": "bfloat16 weights, kvram AdamW8bit (stochastic rounding), kvram.Model(update_in_backward=True; "
                   "skip_nonfinite per --skip-nonfinite), a Checkpoint on every block, efficient_attention, "
                   "lean_activations, fused_cross_entropy",
    "kvram_factored": "bfloat16 weights, kvram AdamW8bit(factored=True) (stochastic rounding), "
                      "kvram.Model(update_in_backward=True; skip_nonfinite per --skip-nonfinite), a Checkpoint on "
                      "every block, efficient_attention, lean_activations, fused_cross_entropy",
    "kvram_offload": "bfloat16 weights, kvram.Model(host_offload=True): AdamW8bit state and float32 masters in host "
                     "memory, a Checkpoint on every block, efficient_attention, lean_activations, fused_cross_entropy",
    "kvram_gpu": "mixed_bfloat16, kvram AdamW8bit on the device, kvram.Model(accumulation_steps), a Checkpoint on every "
                 "block, efficient_attention, lean_activations, fused_cross_entropy",
}
_ACCUMULATING = ("kvram_offload", "kvram_gpu")
_IN_BACKWARD = ("kvram_state", "kvram_factored")  # kvram's on-device state options (update_in_backward)


def _shape(args, depth) -> dict:
    return dict(vocabulary_size=args.vocabulary, num_layers=depth, num_query_heads=args.heads,
                num_key_value_heads=args.kv_heads, hidden_dim=args.hidden, intermediate_dim=args.intermediate)


def _steps_per_execution(value: str):
    """--steps-per-execution: "default" (kvram.Model's "auto", up to 16 steps; plain Keras's 1) or a
    whole number of 1 or more."""
    if value == "default":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f'takes "default" or a whole number of 1 or more, not {value!r}')
    return int(value)


def child(name, depth, args):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    set_kvram_switches({"plain": name == "keras_adamw"})  # Keras's run without kvram's XLA flags and pinning
    import kvram  # noqa: F401  (before TensorFlow: its XLA flags and allocator statistics)
    import tensorflow as tf

    if args.device.startswith("GPU"):
        cap_first_gpu(args.gpu_memory_gib)
    import keras
    import keras_hub
    import numpy as np

    from benchmarks.common import timed_fit
    from kvram import remat

    lean = name in _IN_BACKWARD + _ACCUMULATING
    on_device = name == "kvram_offload" and args.update_device == "gpu"  # HostOffload(update_device=the GPU)
    keras.config.set_dtype_policy("bfloat16" if name in _IN_BACKWARD + ("kvram_offload",) else "mixed_bfloat16")
    keras.utils.set_random_seed(0)
    shape = _shape(args, depth)
    backbone = keras_hub.models.LlamaBackbone(**shape)
    # LlamaCausalLM's head: the backbone's ReversibleEmbedding, reversed (its own, untied, kernel)
    model = keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True),
                        name="llama_causal_lm")
    if lean:
        kvram.speed.efficient_attention(model, chunk_size=args.sequence)
        kvram.speed.lean_activations(model)
    chain = remat.segments(model)
    blocks = [any(n.startswith("transformer_layer") for n in s.layers) for s in chain]
    model = remat.rebuild(model, [[i] for i in range(len(chain))], blocks, row_chunks=args.row_chunks)
    if name in _ACCUMULATING:
        # the guard would wait for every gradient
        runs = name == "kvram_offload" and (args.host_groups > 1 or on_device)
        model = kvram.Model(model.input, model.output, host_offload=name == "kvram_offload",
                            accumulation_steps=args.accumulation, name=model.name,
                            **({"skip_nonfinite": bool(args.skip_nonfinite)} if runs else {}))
        optimizer = kvram.optimizers.AdamW8bit(1e-4, weight_decay=0.01)  # float32 weights or masters
        if runs or (name == "kvram_offload" and args.block_inputs == "host"):
            optimizer = kvram.optimizers.HostOffload(optimizer, groups=args.host_groups,
                                                     update_device=args.device if on_device else None,
                                                     block_inputs=args.block_inputs)
    elif lean:
        model = kvram.Model(model.input, model.output, update_in_backward=True, name=model.name,
                            skip_nonfinite=bool(args.skip_nonfinite))
        optimizer = kvram.optimizers.AdamW8bit(1e-4, weight_decay=0.01, rounding="stochastic",
                                               factored=name == "kvram_factored")
    else:
        optimizer = keras.optimizers.AdamW(1e-4, weight_decay=0.01)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True,
                  **({} if args.steps_per_execution == "default" else {"steps_per_execution": args.steps_per_execution}))
    if lean:
        kvram.speed.fused_cross_entropy(model, chunk_size=args.head_chunk)
    rng = np.random.default_rng(0)
    x = {"token_ids": tf.constant(rng.integers(0, args.vocabulary, (args.batch, args.sequence)), tf.int32),
         "padding_mask": tf.ones((args.batch, args.sequence), tf.int32)}
    y = tf.constant(rng.integers(0, args.vocabulary, (args.batch, args.sequence)), tf.int32)
    parameters = int(model.count_params())
    trainable = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    started = time.perf_counter()
    timed = timed_fit(model, tf.data.Dataset.from_tensors((x, y)).repeat(), args.steps, args.warmup, [args.device],
                      last_loss=True)
    tokens_per_s = args.batch * args.sequence * timed["steps"] / timed["seconds"]
    flops = 6 * parameters + 12 * depth * args.hidden * args.sequence
    child_result({"label": CONFIGS[name], "parameters": parameters, "trainable_parameters": trainable,
                  "weights_dtype": model.trainable_variables[0].dtype, "trained": True,
                  "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / (args.peak_tflops * 1e12),
                  "peak_gib": timed["peak_gib"][args.device], "resident_gib": timed["resident_gib"][args.device],
                  "final_loss": timed["loss"], "last_loss": timed["last_loss"],
                  "last_loss_steps": timed["last_loss_steps"],
                  "timed_steps": timed["steps"], "timed_window": timed["timed_window"],
                  "warmup_steps": timed["warmup_steps"], "warmup_s": timed["warmup_seconds"],
                  "wall_s_with_compile": time.perf_counter() - started,
                  "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "batches_per_update": args.accumulation if name in _ACCUMULATING else 1,
                  "update_device": (args.device if on_device else "host") if name == "kvram_offload" else None,
                  "xla_flags": os.environ.get("XLA_FLAGS", ""),
                  "versions": versions()})


def _first_error_line(text: str) -> str:
    for marker in ("killed by SIG", "timed out after", "ResourceExhaustedError", "Out of memory", "OOM", "Error"):
        for line in text.splitlines():
            if marker in line:
                return line.strip()[:400]
    return text.strip().splitlines()[-1][:400] if text.strip() else "no output"


def _error_tail(text: str, lines: int = 12) -> str:
    """The last `lines` lines of a child's output that are not TensorFlow's log lines or stack frames."""
    kept = [line for line in text.splitlines()
            if line.strip() and not line.startswith(("I0000", "W0000")) and not line.lstrip().startswith("File ")]
    return "\n".join(kept[-lines:])[-3000:]


def _runs(text: str):
    runs = []
    for item in text.split(","):
        name, _, depth = item.partition(":")
        if name not in CONFIGS or not depth.isdigit() or int(depth) < 1:
            raise SystemExit(f"--runs takes configuration:depth items ({', '.join(CONFIGS)}; depth >= 1), "
                             f"got {item!r}")
        runs.append((name, int(depth)))
    return runs


def summary(runs: list) -> dict:
    """Per configuration, the largest depth (and parameters) that trained; kvram's over Keras's."""
    largest = {}
    for run in runs:
        if run.get("trained") and run["parameters"] > largest.get(run["config"], {}).get("parameters", 0):
            largest[run["config"]] = {"depth": run["depth"], "parameters": run["parameters"],
                                      "tokens_per_s": run["tokens_per_s"], "mfu": run["mfu"],
                                      "peak_gib": run["peak_gib"]}
    out = {"largest_trained": largest}
    kvram = [largest[c]["parameters"] for c in _IN_BACKWARD if c in largest]
    if "keras_adamw" in largest and kvram:
        out["kvram_parameters_over_keras"] = max(kvram) / largest["keras_adamw"]["parameters"]
    return out


_SHAPE = ("gpu_memory_gib", "sequence", "batch", "row_chunks", "host_groups", "hidden", "intermediate", "heads",
          "kv_heads", "vocabulary", "steps", "warmup", "peak_tflops", "device")


def combine(paths: list) -> dict:
    """One report of the runs in `paths`: result files of this script (or reports this function
    made) of one GPU and one shape, each run keeping its own date, commit and command."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    first = reports[0]
    for path, report in zip(paths, reports):
        differs = [k for k in _SHAPE if report["settings"].get(k) != first["settings"].get(k)]
        if report["gpu"] != first["gpu"]:
            differs.append("gpu")
        if differs:
            raise SystemExit(f"--combine takes runs of one shape on one GPU: {path} differs from {paths[0]} "
                             f"in {', '.join(differs)}")
    # a combined report's runs keep their own date, commit and command
    runs = [{"date": r["date"], "commit": r["commit"], "command": r["command"], **run}
            for r in reports for run in r["runs"]]
    return {**result_header("optimizers-capacity", __file__), "gpu": first["gpu"],
            "settings": {k: first["settings"].get(k) for k in _SHAPE}, "configs": CONFIGS, "runs": runs,
            **summary(runs)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="keras_adamw:23,keras_adamw:24,kvram_factored:99",
                        help="configuration:depth items, comma-separated, each in its own process")
    parser.add_argument("--gpu-memory-gib", type=float, default=24.0)
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocabulary", type=int, default=32000)
    parser.add_argument("--accumulation", type=int, default=8, help="batches per update (kvram_offload)")
    parser.add_argument("--row-chunks", type=int, default=None,
                        help="each checkpointed block runs a step's --batch rows in this many slices, one after "
                             "another (Checkpoint row_chunks): a step of --batch rows makes each gradient once")
    parser.add_argument("--host-groups", type=int, default=1,
                        help="kvram_offload: HostOffload(groups=N), each run of weights updated once its gradients "
                             "are on the host (then skip_nonfinite per --skip-nonfinite)")
    parser.add_argument("--update-device", choices=("host", "gpu"), default="host",
                        help="kvram_offload: where the update's arithmetic runs (the masters and state stay the host's)")
    parser.add_argument("--block-inputs", choices=("device", "host"), default="device",
                        help="kvram_offload: where row-chunked blocks keep their inputs between their passes "
                             "(HostOffload(block_inputs=...))")
    parser.add_argument("--skip-nonfinite", type=int, choices=(0, 1), default=0,
                        help="kvram_state/kvram_factored: 1 guards each step (a second backward pass decides "
                             "the skip), 0 applies every step as Keras does (the default)")
    parser.add_argument("--head-chunk", type=int, default=1024,
                        help="tokens per chunk of the fused head and loss (fused_cross_entropy's chunk_size): each "
                             "chunk holds a few (chunk, vocabulary) float32 buffers, 0.5 GiB each at 1024 x 128256")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=_steps_per_execution, default="default",
                        help="compile's steps_per_execution: \"default\" (kvram.Model's \"auto\", up to 16 steps, "
                             "to which --steps and --warmup round up; Keras's 1) or N: 1 for a step of seconds")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 TFLOP/s, for MFU")
    parser.add_argument("--device", default="GPU:0", help="TensorFlow device (CPU:0 for a smoke run: no cap)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--stderr-dir", default=None,
                        help="write each run's whole stderr there (with TF_CPP_MIN_LOG_LEVEL=0, the GPU allocator's "
                             "summary at an out-of-memory error)")
    parser.add_argument("--combine", nargs="+", default=None, metavar="RESULT",
                        help="result files of runs made side by side (one GPU, one shape): write one of all their runs")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.combine:
        report = combine(args.combine)
        write_result(args.out, report)
        return print(json.dumps({k: report[k] for k in report if k in ("largest_trained", "kvram_parameters_over_keras")}))
    if args.child:
        name, _, depth = args.child.partition(":")
        return child(name, int(depth), args)
    forwarded = without_options(sys.argv[1:], ("--out", "--stderr-dir"))
    runs = []
    for name, depth in _runs(args.runs):
        started = time.perf_counter()
        with HostMemoryWatch() as host:
            records, error, stderr = run_child([sys.executable, __file__, *forwarded, "--child", f"{name}:{depth}"],
                                               args.timeout)
        if args.stderr_dir:  # the whole of it: an out-of-memory error's allocator summary is longer than the tail
            os.makedirs(args.stderr_dir, exist_ok=True)
            with open(os.path.join(args.stderr_dir, f"{name}_{depth}.stderr"), "w") as f:
                f.write(stderr or "")
        # the first error line can be a bare C++ frame (XLA's status macros): the tail says what the error was
        run = {"trained": False, "error": _first_error_line(error), "error_tail": _error_tail(error)} if error \
            else records[-1]
        # how far it got, and the memory in use before its first step (timed_fit's stage lines)
        run.update(config=name, depth=depth, wall_s=time.perf_counter() - started, stages=stage_lines(stderr),
                   host_available_least_gib=host.least_gib)
        runs.append(run)
        text = (f"{run['parameters'] / 1e9:.2f} B parameters, {run['tokens_per_s']:.0f} tokens/s, "
                f"MFU {run['mfu']:.1%}, peak {run['peak_gib']} GiB" if run["trained"] else f"did not train: {run['error']}")
        print(f"{name} depth {depth}: {text} ({run['wall_s']:.0f} s)", flush=True)
        report = {**result_header("optimizers-capacity", __file__),
                  "gpu": gpu_name() if args.device.startswith("GPU") else f"none ({args.device}, a smoke run)",
                  "settings": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
                  "configs": CONFIGS, "runs": runs, **summary(runs)}
        write_result(args.out, report)  # after each run: a run cut short keeps the others
    print(json.dumps(summary(runs)), flush=True)


if __name__ == "__main__":
    main()
