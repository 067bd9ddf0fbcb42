"""ViT-B/16 training on one GPU: plain Keras, kvram and PyTorch, in one run.

The TensorFlow model is `models/vit.py` (86.6 M parameters), PyTorch's torchvision's
`vit_b_16`. PyTorch's batch stays on the GPU; TensorFlow's is held by `tf.data` on the
host and copied every step. The configurations and how to run them: README.md."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import image_runners, set_kvram_switches, training_main  # noqa: E402

# what kvram's fast configurations share: MemoryEfficientAttention as cuDNN's fused attention in
# XLA's step, kvram.speed.lean_activations, bf16
_FAST = dict(policy="mixed_bfloat16", attention="efficient", attention_impl="cudnn", lean=True)

# name: (framework, label, settings)
CONFIGS = {
    "keras_bf16": ("tf", "plain Keras: keras.layers.MultiHeadAttention, mixed_bfloat16, XLA",
                   dict(plain=True, policy="mixed_bfloat16", attention="keras", checkpoint=False)),
    "kvram_default": ("tf", "kvram, the README's usage: precision \"auto\", MemoryEfficientAttention",
                      dict(policy="auto", attention="efficient", checkpoint=False)),
    "kvram_fast": ("tf", "kvram, cuDNN attention, lean_activations, no checkpointing",
                   dict(_FAST, checkpoint=False)),
    "kvram_ckpt10": ("tf", "kvram, the same with a Checkpoint on 10 of the 12 blocks", dict(_FAST, checkpoint=10)),
    "kvram_lean": ("tf", "kvram, the same with a Checkpoint on every block", dict(_FAST, checkpoint=True)),
    "torch_fp16_compile": ("torch", "PyTorch torch.compile(torchvision vit_b_16), fp16 autocast, fused AdamW",
                           dict(dtype="float16", compile=True)),
}


def build_tf(settings, batch, device):
    """The model of a TensorFlow configuration, compiled, and its data: one synthetic
    batch repeated by `tf.data` on the host. Plain Keras is a `keras.Model` over the
    same layers, compiled with XLA, one batch a call, Keras's own einsum."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    set_kvram_switches(settings)  # before import kvram: what it does by default, for kvram's configurations
    import keras
    import tensorflow as tf

    import kvram
    from models.vit import vit_b16

    kvram.precision.enable(settings["policy"])
    with tf.device(device):
        # cuDNN's attention refuses to run off a GPU (a smoke run on the CPU: the chunks)
        implementation = settings.get("attention_impl", "auto") if device.startswith("GPU") else "auto"
        model = vit_b16(attention=settings["attention"], checkpoint=settings["checkpoint"],
                        attention_implementation=implementation)
        if settings.get("lean"):
            kvram.speed.lean_activations(model)
        tuning = {}
        if settings.get("plain"):
            kvram.speed.tensordot_einsum(enable=False)
            model = keras.Model(model.input, model.output, name="vit_b16")
            tuning = dict(jit_compile=True)
        model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **tuning)
        x = tf.random.uniform((batch, 224, 224, 3))
        y = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32)
    return model, tf.data.Dataset.from_tensors((x, y)).repeat()


def torch_step(settings, batch):
    """(step, model) of a PyTorch configuration: torchvision's vit_b_16, AdamW,
    autocast; `step()` runs one training step and returns its loss."""
    import torch
    import torchvision

    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, settings["dtype"]) if cuda == "cuda" else torch.bfloat16
    model = torchvision.models.vit_b_16().to(cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda == "cuda")
    if settings.get("compile"):
        model = torch.compile(model)
    scaler = torch.amp.GradScaler(cuda, enabled=dtype == torch.float16)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.rand(batch, 3, 224, 224, device=cuda)
    y = torch.randint(0, 1000, (batch,), device=cuda)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(cuda, dtype=dtype):
            loss = loss_fn(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step, model


def main():
    training_main(__doc__, __file__, "vit_b16-train", CONFIGS, image_runners(build_tf, torch_step),
                  {"batch": 256, "steps": 160, "warmup": 40})


if __name__ == "__main__":
    main()
