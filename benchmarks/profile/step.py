"""Where a ResNet50, ViT-B/16 or decoder training step's time goes: TensorFlow/Keras vs PyTorch, on the GPU.

Each configuration (those of the model's suite, `benchmarks/<model>/bench.py`) runs in
its own process: timed steps without the profiler, then profiled steps whose GPU kernels
`kernels.py` sorts into kinds of work. XLA configurations also dump the optimized HLO
(`--xla_dump_to`): for the transformers each top kernel carries its HLO instruction's
shape, opcode and TensorFlow op name (`hlo_shape`, `hlo_opcode`, `tf_op`), and
`kernels.by_part` gives the time by part; for the decoder `img_per_s` is rows/s and
`tokens_per_s` is reported too. How to run it: README.md."""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from benchmarks.common import (  # noqa: E402
    child_result, gpu_name, result_header, run_children, timed_fit, timed_torch_steps, torch_environment,
    whole_executions, without_options, write_result,
)

# the transformer models: each kernel's time also by part (`kernels.by_part`),
# from the op names of the step's HLO, which is always dumped for them
_BY_PART = ("vit", "decoder")


def _xla_dump_dir(raw_dir, name):
    return os.path.join(raw_dir or tempfile.gettempdir(), f"hlo_{name}")


def _configs(model):
    """{name: (framework, settings)}: the configurations of the model's suite."""
    import importlib

    suite = importlib.import_module(f"benchmarks.{model}.bench")
    return {name: (framework, settings) for name, (framework, _, settings) in suite.CONFIGS.items()}


def _decoder_args(args):
    """`args` as the decoder suite reads them: its `--model` is the decoder's shape (`--decoder`)."""
    return argparse.Namespace(**{**vars(args), "model": args.decoder})


def run_tf(name, settings, args):
    import tensorflow as tf

    from kernels import (
        breakdown, by_part, describe_top_kernels, gaps, hlo_instructions, op_names, read_xspace, xspace_kernels,
    )

    batch, device = args.batch, args.device
    if args.model == "vit":
        from benchmarks.vit.bench import build_tf as build_vit

        model, data = build_vit(settings, batch, device)
    elif args.model == "decoder":
        from benchmarks.decoder.bench import build as build_decoder

        model, data = build_decoder(settings, _decoder_args(args))
    else:
        from benchmarks.resnet50.bench import build_tf

        model, data = build_tf(settings, batch, device, args.image_size)
    timed = timed_fit(model, data, args.steps, args.warmup, [device])
    result = {
        "settings": settings,
        "img_per_s": batch * timed["steps"] / timed["seconds"],
        "step_ms": timed["seconds"] / timed["steps"] * 1e3,
        "peak_gib": timed["peak_gib"][device],
        "final_loss": timed["loss"],
    }
    if args.model == "decoder":
        result["tokens_per_s"] = result["img_per_s"] * args.sequence
    logdir = tempfile.mkdtemp(prefix=f"tfprof_{name}_")
    profile_steps = whole_executions(args.profile_steps, int(model.steps_per_execution or 1))
    try:
        tf.profiler.experimental.start(logdir)
        model.fit(data, steps_per_epoch=profile_steps, epochs=1, verbose=0)
        tf.profiler.experimental.stop()
        planes = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        space = read_xspace(planes[0]) if planes else None
        kernels = xspace_kernels(space) if planes else []
        result["profile"] = breakdown(kernels, profile_steps) if kernels else {
            "kernels": 0, "note": f"no GPU kernels in the trace ({len(planes)} xplane files)"}
        if kernels:
            result["gaps"] = gaps(kernels, profile_steps)
        if kernels and args.model in _BY_PART:
            instructions = hlo_instructions(_xla_dump_dir(args.raw_dir, name))
            result["profile"]["hlo_instructions_named"] = len(instructions)
            result["profile"]["parts_ms_per_step"] = by_part(kernels, profile_steps, op_names(instructions))
            describe_top_kernels(result["profile"], instructions)
        _keep_raw(args.raw_dir, name, kernels)
    except Exception as error:  # noqa: BLE001 - the timing above still stands
        result["profile"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    return result


def run_torch(name, settings, args):
    import torch

    from kernels import breakdown, by_part, chrome_trace_kernels

    batch = args.batch
    if args.model == "vit":
        from benchmarks.vit.bench import torch_step as vit_step

        step, _ = vit_step(settings, batch)
    elif args.model == "decoder":
        from benchmarks.decoder.bench import torch_step as decoder_step

        step, _ = decoder_step(settings, _decoder_args(args))
    else:
        from benchmarks.resnet50.bench import torch_step

        step, _ = torch_step(settings, batch)
    timed = timed_torch_steps(step, args.steps, args.warmup)
    result = {
        "settings": settings,
        "img_per_s": batch * args.steps / timed["seconds"],
        "step_ms": timed["seconds"] / args.steps * 1e3,
        "peak_gib": timed["peak_gib"],
        "final_loss": timed["loss"],
    }
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    kernels = chrome_trace_kernels(trace)
    result["profile"] = breakdown(kernels, args.profile_steps)
    if args.model in _BY_PART:
        result["profile"]["parts_ms_per_step"] = by_part(kernels, args.profile_steps)
    _keep_raw(args.raw_dir, name, kernels)
    return result


def _keep_raw(raw_dir, name, kernels):
    """Writes the kernel records (and the largest optimized HLO module) for later analysis."""
    if not raw_dir:
        shutil.rmtree(_xla_dump_dir(raw_dir, name), ignore_errors=True)
        return
    os.makedirs(raw_dir, exist_ok=True)
    with gzip.open(os.path.join(raw_dir, f"kernels_{name}.json.gz"), "wt") as f:
        json.dump(kernels, f)
    dump = _xla_dump_dir(raw_dir, name)
    modules = glob.glob(os.path.join(dump, "*after_optimizations.txt"))
    if modules:
        largest = max(modules, key=os.path.getsize)
        with open(largest, "rb") as src, gzip.open(os.path.join(raw_dir, f"hlo_{name}.txt.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(dump, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("resnet50", "vit", "decoder"), required=True)
    parser.add_argument("--only", action="append", help="a configuration (default: all of the model's)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--device", default="GPU:0", help="TensorFlow device (CPU:0: smoke test)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--sequence", type=int, default=1024, help="--model decoder: tokens per row")
    parser.add_argument("--decoder", choices=("gpt2", "llama"), default="gpt2", help="--model decoder: its shape")
    parser.add_argument("--layers", type=int, default=None, help="--model decoder: decoder blocks (default: the shape's)")
    parser.add_argument("--raw-dir", default=None, help="keep kernel records and HLO here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = _configs(args.model)
    unknown = sorted(set(args.only or ()) - set(configs))
    if unknown:
        parser.error(f"unknown --only {unknown} for --model {args.model}; choose from {sorted(configs)}")
    if args.child:
        framework, settings = configs[args.child]
        runner = run_tf if framework == "tf" else run_torch
        child_result(runner(args.child, settings, args))
        return

    def environment(name):
        """The child's environment: PyTorch's without a staged cuDNN; XLA's dump of the step's HLO."""
        framework, settings = configs[name]
        env = dict(torch_environment() if framework == "torch" else os.environ, **settings.get("env", {}))
        flags = [env.get("XLA_FLAGS", ""), settings.get("xla_flags", "")]
        if framework == "tf" and (args.model in _BY_PART or args.raw_dir):
            flags += [f"--xla_dump_to={_xla_dump_dir(args.raw_dir, name)}", "--xla_dump_hlo_as_text"]
        env["XLA_FLAGS"] = " ".join(f for f in flags if f)
        return env

    def describe(result):
        prof = result.get("profile", {})
        kinds = prof.get("kinds_ms_per_step", {})
        return (f"{result['img_per_s']:7.0f} img/s {result['step_ms']:6.1f} ms/step "
                f"{result['peak_gib'] or 0:6.2f} GiB | busy {prof.get('busy_ms_per_step', 0):.1f} "
                f"idle {prof.get('idle_ms_per_step', 0):.1f} ms | "
                + " ".join(f"{k}={v:.1f}" for k, v in list(kinds.items())[:8]))

    def write(results):  # after each configuration: a later stall loses nothing
        write_result(args.out, {**result_header(f"profile-{args.model}-step", __file__), "gpu": gpu_name(),
                                "batch": args.batch, "steps": args.steps, "results": results})

    run_children(__file__, args.only or list(configs), without_options(sys.argv[1:], ("--out", "--only")),
                 describe, args.timeout, environment, each=write)


if __name__ == "__main__":
    main()
