"""ViT-B/16 training on one GPU: plain Keras fp32 vs kvram vs PyTorch, in one run.

Each configuration runs in its own process, on one synthetic batch of 224x224
images (on the GPU for PyTorch; for TensorFlow held by `tf.data` on the host and
copied to the GPU every step, as in benchmarks/resnet50/bench.py), with AdamW
(lr 1e-4), and reports images/s over timed steps after warm-up, and the peak GPU
memory allocated by the framework during them (TF: `get_memory_info(...)["peak"]`;
PyTorch: `torch.cuda.max_memory_allocated()`; both include weights, gradients and
optimizer state).

    python benchmarks/vit/bench.py --out results.json        # all configurations
    python benchmarks/vit/bench.py --only kvram --batch 256  # one

Configurations:
    keras_fp32     models/vit.py with keras.layers.MultiHeadAttention, no
                   checkpointing, float32 (TF32 matmuls, TF's default), XLA.
    keras_bf16     the same under mixed_bfloat16.
    kvram          kvram: mixed_bfloat16 + a Checkpoint per encoder block +
                   MemoryEfficientAttention, XLA.
    kvram_nockpt   kvram without checkpointing (mixed_bfloat16 + the attention).
    torch_fp16     torchvision vit_b_16, fp16 autocast + GradScaler.
    torch_bf16     torchvision vit_b_16, bf16 autocast.
    torch_fp16_compile  torchvision vit_b_16 in `torch.compile(model)` (default
                   mode), fp16 autocast + GradScaler, fused AdamW: what a
                   PyTorch user gets with one line. Its compilation (the
                   first warm-up step) is reported as `first_step_s`, not timed.
    kvram_cudnn_*  MemoryEfficientAttention as cuDNN's fused attention
                   (implementation="cudnn"), cuBLASLt GEMMs, spe16, pinned:
                   without checkpointing, with lean activations, with a
                   Checkpoint per block (full or save_dots). The other kvram
                   configurations keep the chunked attention they measured.
    kvram_cudnn_lean_nockpt_resident  the lean step with its batch kept on
                   the GPU (no copy a step, as the PyTorch configurations run):
                   `model.train_step` XLA-compiled, 16 a call, not `fit`;
                   `_resident_unguarded` the same without the guard.
    kvram_cudnn_lean_*_float8  the lean step with Keras's float8 training
                   (`model.quantize("float8")`: Dense and EinsumDense layers).
    kvram_cudnn_lean_*_noexcess  XLA_FLAGS --xla_allow_excess_precision=false
                   (bf16 values rounded where the graph says).
    kvram_cudnn_lean_nockpt_keras_einsum  Keras's einsum instead of kvram's
                   (`kvram.speed.tensordot_einsum(enable=False)`).
    kvram_cudnn_lean_*_patchmatmul  the patch embedding as a GEMM over
                   reshaped patches instead of a conv (models.vit.patch_embedding).
    torch_fp16_compile_hostbatch  torch_fp16_compile copying its batch from
                   pinned host memory each step (`.cuda(non_blocking=True)`), as
                   a DataLoader with pin_memory=True feeds it.
"""

from __future__ import annotations

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    add_xla_flags, set_kvram_switches, timed_fit, timed_resident_steps, timed_torch_steps, track_gpu_frees,
    training_main, use_keras_loop, versions,
)

# XLA without excess precision, and (name suffix, XLA flags added) for a configuration as it is and with it
_NOEXCESS = " --xla_allow_excess_precision=false"
_EXCESS_OR_NOT = (("", ""), ("_noexcess", _NOEXCESS))
# what every kvram_cudnn_* configuration shares
_CUDNN = dict(policy="mixed_bfloat16", attention="efficient", attention_impl="cudnn", spe=16, pin=True,
              xla_flags="--xla_gpu_enable_cublaslt=true")

CONFIGS = {
    "keras_fp32": ("tf", dict(policy="float32", attention="keras", checkpoint=False)),
    "kvram": ("tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=True)),
    "torch_fp16": ("torch", dict(dtype="float16")),
    "keras_bf16": ("tf", dict(policy="mixed_bfloat16", attention="keras", checkpoint=False)),
    "kvram_nockpt": ("tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False)),
    "torch_bf16": ("torch", dict(dtype="bfloat16")),
    "torch_fp16_compile": ("torch", dict(dtype="float16", compile=True, fused=True)),
    # issue 11: compile(steps_per_execution=16)
    "kvram_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=True, spe=16)
    ),
    "kvram_nockpt_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, spe=16)
    ),
    # kvram.speed.pin_host_memory()
    "kvram_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=True, spe=16, pin=True)
    ),
    "kvram_nockpt_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, spe=16, pin=True)
    ),
    # Checkpoint(block, policy="save_dots"): the blocks' products kept, the rest recomputed
    "kvram_dots_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=True, ckpt_policy="save_dots",
                   spe=16, pin=True)
    ),
    # keras.layers.MultiHeadAttention (bf16 scores, XLA-fused) in kvram's model and data path
    "kvram_mha_nockpt_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="keras", kvram_data=True, checkpoint=False, spe=16, pin=True)
    ),
    "kvram_mha_dots_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="keras", kvram_data=True, checkpoint=True,
                   ckpt_policy="save_dots", spe=16, pin=True)
    ),
    "kvram_mha_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="keras", kvram_data=True, checkpoint=True, spe=16, pin=True)
    ),
    # kvram.speed.lean_activations: GELU and LayerNorm keep only their inputs
    "kvram_lean_nockpt_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, lean=True, spe=16, pin=True)
    ),
    "kvram_lean_dots_pin_spe16": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=True, ckpt_policy="save_dots",
                   lean=True, spe=16, pin=True)
    ),
    # XLA's latency-hiding scheduler
    "kvram_nockpt_pin_spe16_lhs": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true")
    ),
    # XLA's cuDNN fused attention rewrite, on Keras's MultiHeadAttention (its plain
    # softmax(QK^T)V graph is what the rewrite matches); and XLA's CUDA command buffers off
    "kvram_mha_nockpt_pin_spe16_fmha": (
        "tf", dict(policy="mixed_bfloat16", attention="keras", kvram_data=True, checkpoint=False, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_cudnn_fmha=true")
    ),
    # cuBLASLt GEMMs (bias and activation epilogues fused into the matmul), and Triton GEMMs off
    "kvram_mha_nockpt_pin_spe16_cublaslt": (
        "tf", dict(policy="mixed_bfloat16", attention="keras", kvram_data=True, checkpoint=False, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_cublaslt=true")
    ),
    "kvram_nockpt_pin_spe16_cublaslt": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_cublaslt=true")
    ),
    "kvram_lean_nockpt_pin_spe16_cublaslt": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, lean=True, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_cublaslt=true")
    ),
    "kvram_mha_nockpt_pin_spe16_notriton": (
        "tf", dict(policy="mixed_bfloat16", attention="keras", kvram_data=True, checkpoint=False, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_triton_gemm=false")
    ),
    "kvram_nockpt_pin_spe16_nocmdbuf": (
        "tf", dict(policy="mixed_bfloat16", attention="efficient", checkpoint=False, spe=16, pin=True,
                   xla_flags="--xla_gpu_enable_command_buffer=")
    ),
    # MemoryEfficientAttention as cuDNN's fused attention (the custom calls of
    # kvram/layers/_cudnn_attention.py), with cuBLASLt GEMMs; the configurations
    # above keep its chunked attention
    "kvram_cudnn_nockpt": ("tf", dict(_CUDNN, checkpoint=False)),
    "kvram_cudnn_lean_nockpt": ("tf", dict(_CUDNN, checkpoint=False, lean=True)),
    # XLA rewrites not tried before, each beside cuBLASLt: LayerNormalization patterns as cuDNN's norm
    # kernels (CudnnNormRewriter), and normalization-like fusions as Triton block-level fusions
    "kvram_cudnn_lean_nockpt_cudnn_ln": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True,
                   xla_flags=_CUDNN["xla_flags"] + " --xla_gpu_enable_cudnn_layer_norm=true")
    ),
    "kvram_cudnn_lean_nockpt_block_level": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True,
                   xla_flags=_CUDNN["xla_flags"] + " --xla_gpu_experimental_enable_fusion_block_level_rewriter=true")
    ),
    # cuDNN's GEMM fusions as candidates of XLA's GEMM fusion autotuner (Hopper, cuDNN 9), levels 1 and 3
    **{f"kvram_cudnn_lean_nockpt_cudnn_gemm{level}": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True,
                   xla_flags=_CUDNN["xla_flags"] + f" --xla_gpu_cudnn_gemm_fusion_level={level}")
    ) for level in (1, 3)},
    "kvram_cudnn_ckpt": ("tf", dict(_CUDNN, checkpoint=True)),
    # without batches prefetched to the GPU: two fewer batches held (0.29 GiB at batch 256)
    "kvram_cudnn_ckpt_noprefetch": ("tf", dict(_CUDNN, checkpoint=True, prefetch=None)),
    "kvram_cudnn_dots": ("tf", dict(_CUDNN, checkpoint=True, ckpt_policy="save_dots")),
    "kvram_cudnn_lean_dots": ("tf", dict(_CUDNN, checkpoint=True, ckpt_policy="save_dots", lean=True)),
    # the batch's copy to the GPU: more batches ahead, or none (each step copies its own)
    "kvram_cudnn_lean_nockpt_prefetch8": ("tf", dict(_CUDNN, checkpoint=False, lean=True, prefetch=8)),
    "kvram_cudnn_lean_nockpt_noprefetch": ("tf", dict(_CUDNN, checkpoint=False, lean=True, prefetch=None)),
    # Keras's multi-step loop with its 16 steps unrolled in the loop's body (the model's
    # `unrolled_steps_per_execution`): the loop's condition is read once a call, not once a step
    "kvram_cudnn_lean_nockpt_unroll16": ("tf", dict(_CUDNN, checkpoint=False, lean=True, unroll=16)),
    # the batch copied to the GPU as bfloat16, half the bytes of float32 (2.79 ms a step
    # as float32 in profile_vit_gaps_h200.json); the model's first layer computes in
    # bfloat16 under mixed_bfloat16 either way, so its values are the same
    "kvram_cudnn_lean_nockpt_bf16data": ("tf", dict(_CUDNN, checkpoint=False, lean=True, data_dtype="bfloat16")),
    # Keras's own multi-step loop (its condition on the GPU, waited for once a step), against
    # kvram's loop on the host
    "kvram_cudnn_lean_nockpt_kerasloop": ("tf", dict(_CUDNN, checkpoint=False, lean=True, keras_loop=True)),
    # no skip guard and no skip counting read (skip_nonfinite=False, max_consecutive_skips=None):
    # the step has no XLA conditional, whose predicate XLA's GPU runtime copies to the host
    # and waits for; the upper bound of what the guard's conditionals cost (and without
    # batches prefetched to the GPU)
    "kvram_cudnn_lean_nockpt_unguarded": ("tf", dict(_CUDNN, checkpoint=False, lean=True, unguarded=True)),
    "kvram_cudnn_lean_nockpt_noprefetch_unguarded": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True, prefetch=None, unguarded=True)
    ),
    # labels as int64: TensorFlow keeps a GPU op's int32 tensors in host memory, so each
    # int32 label batch prefetched to the GPU is copied back to the host, and that copy
    # waits for every kernel queued before it (GPUUtil::CopyGPUTensorToCPU); without it the
    # step measured no faster (results/cuda_calls_vit_h200.json, runs[3])
    "kvram_cudnn_lean_nockpt_unguarded_int64labels": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True, unguarded=True, label_dtype="int64")
    ),
    # TensorFlow's timestamped GPU allocator: batches copied to the GPU without waiting for the
    # steps queued ahead of them (common.track_gpu_frees)
    "kvram_cudnn_lean_nockpt_tracked": ("tf", dict(_CUDNN, checkpoint=False, lean=True, track_frees=1)),
    "kvram_cudnn_lean_nockpt_noprefetch_tracked": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True, prefetch=None, track_frees=1)
    ),
    # the same step with its batch kept on the GPU, as the PyTorch configurations keep theirs
    # (`common.timed_resident_steps`: model.train_step XLA-compiled, 16 a call, no copy a step);
    # and PyTorch copying its batch from pinned host memory each step, as a DataLoader with
    # pin_memory=True and .cuda(non_blocking=True) does (without its worker processes)
    "kvram_cudnn_lean_nockpt_resident": ("tf", dict(_CUDNN, checkpoint=False, lean=True, resident=True)),
    # the same without the guard's XLA conditional (whose predicate the host waits for every step)
    "kvram_cudnn_lean_nockpt_resident_unguarded": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True, resident=True, unguarded=True)
    ),
    # lean_activations with every block checkpointed in full (save_dots' kept products were
    # merged with the forward pass by XLA before 3c3f5c3: the 2026-11-26 kvram_cudnn_lean_dots
    # measured 15.59 GiB against 17.34 without checkpointing)
    "kvram_cudnn_lean_ckpt": ("tf", dict(_CUDNN, checkpoint=True, lean=True)),
    # micro-batches of 128 rows (kvram.Model.micro_batch_size: two slices a step, one update),
    # alone and with save_dots
    "kvram_cudnn_lean_nockpt_mb128": ("tf", dict(_CUDNN, checkpoint=False, lean=True, micro_batch=128)),
    "kvram_cudnn_lean_dots_mb128": (
        "tf", dict(_CUDNN, checkpoint=True, ckpt_policy="save_dots", lean=True, micro_batch=128)
    ),
    # the lean step under mixed_float16, the precision torch_fp16_compile runs in (Keras's
    # LossScaleOptimizer, put in place by compile(), scales the loss); cuDNN's attention in F16
    "kvram_cudnn_lean_nockpt_fp16": ("tf", dict(_CUDNN, policy="mixed_float16", checkpoint=False, lean=True)),
    # Keras's float8 training (`model.quantize("float8")`: every Dense and EinsumDense with
    # delayed scaling, its inputs, kernels and output gradients quantized and dequantized in the
    # pattern XLA's GEMM rewriter turns into FP8 GEMMs on Hopper), the lean step without and with
    # a Checkpoint per block
    "kvram_cudnn_lean_nockpt_float8": ("tf", dict(_CUDNN, checkpoint=False, lean=True, float8=True)),
    "kvram_cudnn_lean_ckpt_float8": ("tf", dict(_CUDNN, checkpoint=True, lean=True, float8=True)),
    # the patch embedding as reshapes, a transpose and a GEMM (models.vit.patch_embedding) instead of
    # cuDNN's 3-channel conv (1.68 ms a step in profile_vit_pair_h200.json)
    "kvram_cudnn_lean_nockpt_patchmatmul": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True, patch_embedding="matmul")
    ),
    "kvram_cudnn_lean_ckpt_patchmatmul": ("tf", dict(_CUDNN, checkpoint=True, lean=True, patch_embedding="matmul")),
    # the attention projections' weight gradients as one GEMM each (kvram/_einsum.py: Keras's
    # TF einsum broadcast the weight in a BatchMatMulV2, whose gradient is B GEMMs and a sum), and
    # the lean GELU's forward by erf in float32 (Keras's: erfc, partly in bf16): measured at 19cebb4
    # as kvram_cudnn_lean_nockpt_tensordot (the einsums alone) and these two (results/vit_tensordot_*.json),
    # kvram's defaults since, so these equal kvram_cudnn_lean_nockpt / _ckpt; `keras_einsum` gives
    # Keras's einsum back
    "kvram_cudnn_lean_nockpt_tensordot_erf": ("tf", dict(_CUDNN, checkpoint=False, lean=True)),
    "kvram_cudnn_lean_ckpt_tensordot_erf": ("tf", dict(_CUDNN, checkpoint=True, lean=True)),
    "kvram_cudnn_lean_nockpt_keras_einsum": ("tf", dict(_CUDNN, checkpoint=False, lean=True, keras_einsum=True)),
    # XLA without excess precision: bf16 values rounded where the graph says, not kept in float32
    # between fusions (3446 against 3310 img/s in one call, results/vit_tensordot_*excess_h200.json)
    **{f"kvram_cudnn_lean_{ckpt}_noexcess": (
        "tf", dict(_CUDNN, checkpoint=ckpt == "ckpt", lean=True, xla_flags=_CUDNN["xla_flags"] + _NOEXCESS)
    ) for ckpt in ("nockpt", "ckpt")},
    # XLA's cuDNN attention passes on (--xla_gpu_enable_cudnn_fmha): with them XLA's
    # CudnnFusedMHATransposeFusion folds the transposes around kvram's cuDNN calls into the calls'
    # dimension numbers and output layouts (the q/k/v and gradient transposes: about 4.6 ms a step
    # in results/profile_vit_hlo_h200.json); check outputs first (transformers_gpu.sh part K)
    **{f"kvram_cudnn_lean_nockpt_fmhaflag{flag}": (
        "tf", dict(_CUDNN, checkpoint=False, lean=True,
                   xla_flags=_CUDNN["xla_flags"] + " --xla_gpu_enable_cudnn_fmha=true" + extra)
    ) for flag, extra in _EXCESS_OR_NOT},
    # a Checkpoint on the first 10 or 11 of the 12 blocks (the last keep their activations: about
    # 1 GiB each, (17.04 - 4.90) / 12 in results/vit_tensordot_*.json), for issue 34's bar of
    # <= 0.40x torch_fp16_compile's 17.42 GiB
    **{f"kvram_cudnn_lean_ckpt{blocks}{flag}": (
        "tf", dict(_CUDNN, checkpoint=blocks, lean=True, xla_flags=_CUDNN["xla_flags"] + extra)
    ) for blocks in (10, 11) for flag, extra in _EXCESS_OR_NOT},
    "torch_fp16_compile_hostbatch": ("torch", dict(dtype="float16", compile=True, fused=True, host_batch=True)),
    # the README's usage: precision "auto", MemoryEfficientAttention, no checkpointing,
    # compile() with kvram's defaults, import kvram's pinning
    "kvram_default": ("tf", dict(policy="auto", attention="efficient", checkpoint=False, default=True)),
}


def build_tf(settings, batch, device):
    """The model of a TensorFlow configuration, compiled, and its data: one
    synthetic batch repeated by `tf.data` on the host. Call it before TensorFlow's
    first operation (a configuration that pins host memory pins it here) and with
    the configuration's XLA flags already set (`add_xla_flags`)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    set_kvram_switches(settings)  # what import kvram does by default, only where the configuration says
    import kvram
    from models.vit import vit_b16

    if settings.get("pin"):
        kvram.speed.pin_host_memory()  # before TF's first operation
    if settings.get("track_frees"):
        track_gpu_frees(settings["track_frees"])  # before TF's first operation too
    kvram.precision.enable(settings["policy"])
    with tf.device(device):
        model = vit_b16(
            attention=settings["attention"], checkpoint=settings["checkpoint"],
            policy=settings.get("ckpt_policy", "full"),
            # the configurations from before cuDNN's attention keep the chunks they measured
            attention_implementation=settings.get("attention_impl", "auto" if settings.get("default") else "chunked"),
            patch_embedding_kind=settings.get("patch_embedding", "conv"),
        )
        if settings.get("keras_einsum"):  # Keras's own einsum, not kvram's tensordot (kvram/_einsum.py)
            kvram.speed.tensordot_einsum(enable=False)
        if settings.get("lean"):
            kvram.speed.lean_activations(model)
        if settings.get("float8"):
            with warnings.catch_warnings():  # "Layer Conv2D does not have a `quantize` method", ...
                warnings.simplefilter("ignore", UserWarning)
                model.quantize("float8")
        if settings["attention"] == "keras" and not settings.get("kvram_data"):
            model.prefetch_to_gpu = None  # plain Keras: no kvram data path either
            kvram.speed.tensordot_einsum(enable=False)  # and Keras's own einsum
        if settings.get("keras_loop"):
            use_keras_loop(model)
        if settings.get("unguarded"):
            model.skip_nonfinite, model.max_consecutive_skips = False, None
        if "micro_batch" in settings:  # each step's forward and backward over slices of these rows
            model.micro_batch_size = settings["micro_batch"]
        if "prefetch" in settings:  # batches copied ahead to the GPU (None: off)
            model.prefetch_to_gpu = settings["prefetch"]
        # "default": the README's usage, kvram's defaults (XLA on a GPU, steps_per_execution "auto")
        tuning = {} if settings.get("default") else dict(jit_compile=True, steps_per_execution=settings.get("spe", 1))
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **tuning,
        )
        if "unroll" in settings:  # Keras's TensorFlow trainer reads it when it makes its train function
            model.unrolled_steps_per_execution = settings["unroll"]
        x = tf.random.uniform((batch, 224, 224, 3))
        if "data_dtype" in settings:  # the batch as copied to the GPU each step
            x = tf.cast(x, settings["data_dtype"])
        y = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32)
        if "label_dtype" in settings:
            y = tf.cast(y, settings["label_dtype"])
    return model, tf.data.Dataset.from_tensors((x, y)).repeat()


def run_tf(settings, batch, steps, warmup, device):
    add_xla_flags(settings)  # before TensorFlow starts
    model, data = build_tf(settings, batch, device)
    import keras

    timed = (timed_resident_steps if settings.get("resident") else timed_fit)(model, data, steps, warmup, [device])
    return {
        "versions": versions(),
        "settings": settings,
        "parameters": model.count_params(),
        "timed_steps": timed["steps"],
        "img_per_s": batch * timed["steps"] / timed["seconds"],
        "steps_per_execution": int(model.steps_per_execution),
        "host_memory_pinned": __import__("kvram").speed.host_memory_pinned(),
        "dtype_policy": keras.config.dtype_policy().name,
        "float8_layers": sum(getattr(layer, "quantization_mode", None) == "float8" for layer in model._flatten_layers()),
        "peak_gib": timed["peak_gib"][device],
        "final_loss": timed["loss"],
    }


def torch_step(settings, batch):
    """(step, model) of a PyTorch configuration: torchvision's vit_b_16 on the
    GPU, AdamW, autocast; `step()` runs one training step and returns its loss."""
    import torch
    import torchvision

    dtype = getattr(torch, settings["dtype"])
    model = torchvision.models.vit_b_16().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=bool(settings.get("fused")))
    if settings.get("compile"):
        model = torch.compile(model)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.rand(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    if settings.get("host_batch"):  # copied to the GPU each step, from pinned memory
        x_host, y_host = x.cpu().pin_memory(), y.cpu().pin_memory()

    def step():
        if settings.get("host_batch"):
            inputs, labels = x_host.cuda(non_blocking=True), y_host.cuda(non_blocking=True)
        else:
            inputs, labels = x, y
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_fn(model(inputs).float(), labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step, model


def run_torch(settings, batch, steps, warmup, device):
    step, model = torch_step(settings, batch)
    timed = timed_torch_steps(step, steps, warmup)
    return {
        "versions": versions(),
        "settings": settings,
        "parameters": sum(p.numel() for p in model.parameters()),
        "img_per_s": batch * steps / timed["seconds"],
        "peak_gib": timed["peak_gib"],
        "final_loss": timed["loss"],
        "first_step_s": timed["first_step_s"],
    }


def main():
    training_main(
        __doc__, __file__, "vit_b16-train", CONFIGS, {"tf": run_tf, "torch": run_torch},
        {"batch": 256, "steps": 160, "warmup": 40},
    )


if __name__ == "__main__":
    main()
