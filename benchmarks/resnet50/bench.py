"""ResNet50 training on one GPU: plain Keras, kvram and PyTorch, in one run.

Peaks are TensorFlow's `get_memory_info("GPU:0")["peak"]` and PyTorch's
`max_memory_allocated()` (both count weights, gradients and optimizer state).
PyTorch's batch stays on the GPU; TensorFlow's, as any `tf.data` input, is held on the
host and copied to the GPU every step (154 MB of float32 at batch 256). The
configurations and how to run them: README.md."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import image_runners, set_kvram_switches, training_main  # noqa: E402

# name: (framework, label, settings)
CONFIGS = {
    "keras_fp16": ("tf", "plain Keras: keras.applications.ResNet50, mixed_float16, XLA",
                   dict(plain=True, policy="mixed_float16", model="keras")),
    "kvram_default": ("tf", "kvram, the README's usage: precision \"auto\", no checkpointing",
                      dict(policy="auto", model="kvram", ckpt=False)),
    "kvram_fast": ("tf", "kvram, mixed_float16, torchvision's architecture (no conv biases), no checkpointing",
                   dict(policy="mixed_float16", model="kvram", ckpt=False, conv_bias=False)),
    "kvram_lean": ("tf", "kvram, mixed_bfloat16, Checkpoint on stem, conv2_x, conv3_x, BN+ReLU recomputed after",
                   dict(policy="mixed_bfloat16", model="kvram", ckpt=["stem", 2, 3], recompute=True,
                        conv_bias=False)),
    "torch_fp16_compile": ("torch", "PyTorch torch.compile(torchvision resnet50), fp16 autocast, channels_last",
                           dict(segments=0, compile=True)),
    "torch_fp16_ckpt4": ("torch", "PyTorch torchvision resnet50, fp16 autocast, checkpoint_sequential(4)",
                         dict(segments=4)),
}


def build_tf(settings, batch, device, image_size=224):
    """The model (built and compiled) and the data of a TensorFlow configuration:
    plain Keras compiles with XLA and one batch a call; kvram with its defaults."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    set_kvram_switches(settings)  # before import kvram: what it does by default, for kvram's configurations
    import keras
    import tensorflow as tf

    import kvram

    kvram.precision.enable(settings["policy"])
    shape = (image_size, image_size, 3)
    with tf.device(device):
        if settings["model"] == "keras":
            model = keras.applications.ResNet50(weights=None, input_shape=shape)
        else:
            from models.resnet50 import resnet50

            model = resnet50(shape, checkpoint=settings.get("ckpt", True), recompute=settings.get("recompute", ()),
                             conv_bias=settings.get("conv_bias", True))
        tuning = dict(jit_compile=True) if settings.get("plain") else {}
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy",
                      **tuning)
        x = tf.random.uniform((batch, *shape))
        y = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32)
    return model, tf.data.Dataset.from_tensors((x, y)).repeat()


def torch_step(settings, batch):
    """(step, model) of a PyTorch configuration; `step()` trains one batch and returns its loss."""
    import torch
    import torchvision
    from torch.utils.checkpoint import checkpoint_sequential

    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().to(cuda).to(memory_format=torch.channels_last)
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    seq = torch.nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, *stages, model.avgpool,
                              torch.nn.Flatten(), model.fc)
    if settings.get("compile"):
        seq = torch.compile(seq)
    segments = settings["segments"]
    if segments:
        # torchvision's in-place ReLUs overwrite tensors that checkpoint_sequential
        # keeps as segment inputs; autograd refuses that, so they go out of place.
        for module in model.modules():
            if isinstance(module, torch.nn.ReLU):
                module.inplace = False
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(cuda, enabled=cuda == "cuda")
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.rand(batch, 3, 224, 224, device=cuda).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=cuda)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(cuda, dtype=torch.float16 if cuda == "cuda" else torch.bfloat16):
            out = checkpoint_sequential(seq, segments, x, use_reentrant=False) if segments else seq(x)
            loss = loss_fn(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step, model


def main():
    training_main(__doc__, __file__, "resnet50-train", CONFIGS, image_runners(build_tf, torch_step),
                  {"batch": 256, "steps": 320, "warmup": 80})


if __name__ == "__main__":
    main()
