"""ResNet50 training on one GPU: plain Keras vs kvram vs PyTorch, in one run.

Each configuration runs in its own process (clean allocator statistics), on
one synthetic batch, with SGD(momentum=0.9), and reports images/s
over timed steps after warm-up and the peak GPU memory allocated by the framework
during those steps (TF: `get_memory_info(...)["peak"]`; PyTorch:
`torch.cuda.max_memory_allocated()`; both include weights, gradients and
optimizer state).

Input: PyTorch's batch stays on the GPU. TensorFlow's is made on the GPU but,
like any `tf.data` input, is held by the dataset on the host and copied to the
GPU every step (154 MB of float32 at batch 256), as a real input pipeline's
batches are; kvram's `prefetch_to_gpu` overlaps that copy with the previous
step, and `pin=True` (`kvram.speed.pin_host_memory()`) makes it a DMA from
page-locked memory.

    python benchmarks/resnet50/bench.py --out results.json            # all configs
    python benchmarks/resnet50/bench.py --only kvram_bf16_ckpt         # one config
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    add_xla_flags, set_kvram_switches, timed_fit, timed_resident_steps, timed_torch_steps, track_gpu_frees,
    training_main, use_keras_loop,
)

# name: (framework, settings)
# kvram fp16 without checkpointing, pinned, 16 steps a call, with XLA's cuBLASLt GEMMs (on
# ViT-B/16: +3.5-4.6%, benchmarks/results/vit_cublaslt_h200.json): the base of the variants below
_CUBLASLT = dict(policy="mixed_float16", model="kvram", jit=True, ckpt=False, spe=16, pin=True,
                 xla_flags="--xla_gpu_enable_cublaslt=true")

CONFIGS = {
    "keras_fp32": ("tf", dict(policy="float32", model="keras", jit=True)),
    "keras_mixed_float16": ("tf", dict(policy="mixed_float16", model="keras", jit=True)),
    "keras_mixed_bfloat16": ("tf", dict(policy="mixed_bfloat16", model="keras", jit=True)),
    "kvram_fp16_ckpt": ("tf", dict(policy="mixed_float16", model="kvram", jit=True)),
    "kvram_bf16_ckpt": ("tf", dict(policy="mixed_bfloat16", model="kvram", jit=True)),
    "kvram_bf16_ckpt_early": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2, 3])
    ),
    "kvram_bf16_ckpt_stem2": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2])
    ),
    "kvram_bf16_ckpt_nojit": ("tf", dict(policy="mixed_bfloat16", model="kvram", jit=False)),
    # issue 11: kvram.Model prefetches batches to the GPU (prefetch_to_gpu=2, its
    # default); spe = compile(steps_per_execution=...); fused_bn =
    # kvram.speed.fuse_batch_norm; ckpt=False: no checkpointing
    "kvram_fp16": ("tf", dict(policy="mixed_float16", model="kvram", jit=True, ckpt=False)),
    "kvram_fp16_spe16": (
        "tf", dict(policy="mixed_float16", model="kvram", jit=True, ckpt=False, spe=16)
    ),
    "kvram_fp16_fusedbn_spe16": (
        "tf", dict(policy="mixed_float16", model="kvram", jit=True, ckpt=False, spe=16, fused_bn=True)
    ),
    "kvram_bf16_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=False, spe=16)
    ),
    "kvram_bf16_ckpt_spe16": ("tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, spe=16)),
    "kvram_bf16_ckpt_early_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2, 3], spe=16)
    ),
    "kvram_fp16_ckpt_early_spe16": (
        "tf", dict(policy="mixed_float16", model="kvram", jit=True, ckpt=["stem", 2, 3], spe=16)
    ),
    "kvram_bf16_ckpt_stem2_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2], spe=16)
    ),
    "keras_mixed_float16_spe16": (
        "tf", dict(policy="mixed_float16", model="keras", jit=True, spe=16)
    ),
    # pin = kvram.speed.pin_host_memory(); recompute = parts that keep their
    # convolution outputs and recompute only BatchNormalization + ReLU
    "keras_mixed_float16_pin": ("tf", dict(policy="mixed_float16", model="keras", jit=True, pin=True)),
    "kvram_fp16_pin": ("tf", dict(policy="mixed_float16", model="kvram", jit=True, ckpt=False, pin=True)),
    "kvram_fp16_pin_spe16": (
        "tf", dict(policy="mixed_float16", model="kvram", jit=True, ckpt=False, spe=16, pin=True)
    ),
    "kvram_fp16_pin_spe16_cublaslt": (
        "tf", dict(_CUBLASLT)
    ),
    "kvram_bf16_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=False, spe=16, pin=True)
    ),
    "kvram_bf16_ckpt_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, spe=16, pin=True)
    ),
    "kvram_bf16_ckpt_early_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2, 3], spe=16, pin=True)
    ),
    "kvram_bf16_recompute_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=False, recompute=True,
                   spe=16, pin=True)
    ),
    "kvram_bf16_ckpt_early_recompute_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2, 3],
                   recompute=True, spe=16, pin=True)
    ),
    "kvram_bf16_ckpt_stem2_recompute_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", model="kvram", jit=True, ckpt=["stem", 2],
                   recompute=True, spe=16, pin=True)
    ),
    # Keras's own multi-step loop (its condition on the GPU, waited for once a step), against
    # kvram's loop on the host
    "kvram_fp16_pin_spe16_cublaslt_kerasloop": (
        "tf", dict(_CUBLASLT, keras_loop=True)
    ),
    # TensorFlow's timestamped GPU allocator: batches copied to the GPU without waiting for the
    # steps queued ahead of them (common.track_gpu_frees)
    "kvram_fp16_pin_spe16_cublaslt_tracked": (
        "tf", dict(_CUBLASLT, track_frees=1)
    ),
    # the step with its batch kept on the GPU, as the PyTorch configurations keep theirs
    # (common.timed_resident_steps: model.train_step XLA-compiled, 16 a call, no copy a step)
    "kvram_fp16_pin_spe16_cublaslt_resident": (
        "tf", dict(_CUBLASLT, resident=True)
    ),
    # XLA without excess precision (fp16 values rounded where the graph says, not kept in float32
    # between fusions): 4% faster on ViT-B/16's bf16 step (results/vit_tensordot_*excess_h200.json)
    "kvram_fp16_pin_spe16_cublaslt_noexcess": (
        "tf", dict(_CUBLASLT, xla_flags=_CUBLASLT["xla_flags"] + " --xla_allow_excess_precision=false")
    ),
    # the convolutions without biases, as torchvision's resnet50 (which torch_fp16_compile runs) has
    # them: Keras's ResNet50 adds one to each of its 53 convolutions, whose gradient XLA reduces
    # although the BatchNormalization after it cancels it while training
    "kvram_fp16_pin_spe16_cublaslt_nobias": (
        "tf", dict(_CUBLASLT, conv_bias=False)
    ),
    # the batch as uint8 images (a quarter of float32's bytes: 38.5 MB a batch of 256 against
    # 154), as decoded images come; a Rescaling(1/255) in front of the model casts and scales
    # them on the GPU, inside the step, to the float configurations' range [0, 1)
    "kvram_fp16_pin_spe16_cublaslt_uint8": (
        "tf", dict(_CUBLASLT, data_dtype="uint8")
    ),
    # XLA's command buffers (CUDA graphs): every run of commands captured, however short
    # (XLA's default captures runs of 5 or more); and conditionals and loops captured too
    "kvram_fp16_pin_spe16_cublaslt_graph1": (
        "tf", dict(_CUBLASLT, xla_flags=_CUBLASLT["xla_flags"] + " --xla_gpu_graph_min_graph_size=1")
    ),
    "kvram_fp16_pin_spe16_cublaslt_cmdbuf_control": (
        "tf", dict(_CUBLASLT, xla_flags=_CUBLASLT["xla_flags"] + " --xla_gpu_enable_command_buffer="
                   "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE")
    ),
    "torch_fp16": ("torch", dict(segments=0)),
    "torch_fp16_ckpt4": ("torch", dict(segments=4)),
    "torch_fp16_ckpt4_inplace": ("torch", dict(segments=4, inplace=True)),
    # torch.compile(model), default mode, fp16 autocast, channels_last: the
    # strongest PyTorch recipe a user gets in one line; its compilation (the
    # first warm-up step) is reported as first_step_s and not timed
    "torch_fp16_compile": ("torch", dict(segments=0, compile=True)),
    # the README's usage and nothing more: kvram.precision.enable("auto") (bf16 on a
    # GPU with bf16), no checkpointing, compile() with kvram's defaults, import kvram's pinning
    "kvram_default": ("tf", dict(policy="auto", model="kvram", jit="auto", ckpt=False, default=True)),
    "kvram_default_fp16": ("tf", dict(policy="mixed_float16", model="kvram", jit="auto", ckpt=False, default=True)),
}


def build_tf(settings, batch, device, image_size=224):
    """The model (built and compiled) and the data of a TF configuration."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    sys.path.insert(0, ROOT)
    set_kvram_switches(settings)  # what import kvram does by default, only where the configuration says
    import kvram

    if settings.get("pin"):
        kvram.speed.pin_host_memory()  # before TF's first operation
    if settings.get("track_frees"):
        track_gpu_frees(settings["track_frees"])  # before TF's first operation too
    kvram.precision.enable(settings["policy"])
    shape = (image_size, image_size, 3)
    with tf.device(device):
        if settings["model"] == "keras":
            model = keras.applications.ResNet50(weights=None, input_shape=shape)
        else:
            from models.resnet50 import resnet50

            model = resnet50(
                shape, checkpoint=settings.get("ckpt", True), recompute=settings.get("recompute", ()),
                conv_bias=settings.get("conv_bias", True),
            )
        if settings.get("data_dtype") == "uint8":
            images = keras.Input(shape, dtype="uint8")
            model = kvram.Model(images, model(keras.layers.Rescaling(1 / 255)(images)))
        if settings.get("fused_bn"):
            kvram.speed.fuse_batch_norm(model)
        # "default": the README's usage, kvram's defaults (XLA on a GPU, steps_per_execution "auto")
        tuning = {} if settings.get("default") else dict(
            jit_compile=settings["jit"], steps_per_execution=settings.get("spe", 1)
        )
        if settings.get("keras_loop"):
            use_keras_loop(model)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss="sparse_categorical_crossentropy",
            **tuning,
        )
        if settings.get("data_dtype") == "uint8":
            x = tf.cast(tf.random.uniform((batch, *shape), maxval=256, dtype=tf.int32), tf.uint8)
        else:
            x = tf.random.uniform((batch, *shape))
        y = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32)
    return model, tf.data.Dataset.from_tensors((x, y)).repeat()


def run_tf(settings, batch, steps, warmup, device):
    add_xla_flags(settings)  # before TensorFlow starts
    import keras
    import tensorflow as tf

    model, data = build_tf(settings, batch, device)
    timed = (timed_resident_steps if settings.get("resident") else timed_fit)(model, data, steps, warmup, [device])
    return {
        "framework": f"tensorflow {tf.__version__}, keras {keras.__version__}",
        "timed_steps": timed["steps"],
        "settings": settings,
        "img_per_s": batch * timed["steps"] / timed["seconds"],
        "steps_per_execution": int(model.steps_per_execution),
        "host_memory_pinned": __import__("kvram").speed.host_memory_pinned(),
        "dtype_policy": keras.config.dtype_policy().name,
        "peak_gib": timed["peak_gib"][device],
        "final_loss": timed["loss"],
        "skipped_steps": getattr(model, "skipped_steps", None),
    }


def torch_step(settings, batch):
    """One PyTorch training step of a configuration, as a function returning the loss."""
    import torch
    from torch.utils.checkpoint import checkpoint_sequential
    import torchvision

    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    if settings.get("inplace"):
        # The recipe: the 16 bottleneck blocks as separate modules, so
        # that every segment boundary falls between blocks, and torchvision's
        # in-place ReLUs kept.
        stages = [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                  for block in layer]
    else:
        stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    seq = torch.nn.Sequential(
        model.conv1, model.bn1, model.relu, model.maxpool, *stages,
        model.avgpool, torch.nn.Flatten(), model.fc,
    )
    if settings.get("compile"):
        seq = torch.compile(seq)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = getattr(torch, settings.get("dtype", "float16"))
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.rand(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    segments = settings["segments"]
    if segments and not settings.get("inplace"):
        # torchvision's in-place ReLUs overwrite tensors that checkpoint_sequential
        # keeps as segment inputs; autograd refuses that, so they go out of place.
        for module in model.modules():
            if isinstance(module, torch.nn.ReLU):
                module.inplace = False
    # micro: gradient accumulation over slices of that many rows (each slice's
    # loss weighted by its share of the batch), one optimizer step per batch
    micro = settings.get("micro") or batch

    def step():
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.split(micro), y.split(micro)):
            with torch.autocast("cuda", dtype=dtype):
                if segments:
                    out = checkpoint_sequential(seq, segments, xs, use_reentrant=False)
                else:
                    out = seq(xs)
                loss = loss_fn(out.float(), ys)
                if micro < batch:
                    loss = loss * (len(xs) / batch)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


def run_torch(settings, batch, steps, warmup, device):
    import torch
    import torchvision

    timed = timed_torch_steps(torch_step(settings, batch), steps, warmup)
    return {
        "framework": f"torch {torch.__version__}, torchvision {torchvision.__version__}, cuDNN {torch.backends.cudnn.version()}",
        "settings": settings,
        "img_per_s": batch * steps / timed["seconds"],
        "peak_gib": timed["peak_gib"],
        "final_loss": timed["loss"],
        "first_step_s": timed["first_step_s"],
    }


def main():
    training_main(
        __doc__, __file__, "resnet50-train", CONFIGS, {"tf": run_tf, "torch": run_torch},
        {"batch": 256, "steps": 320, "warmup": 80},  # 40 after 8 moved the ratio 0.96-1.04x on one H200
    )


if __name__ == "__main__":
    main()
