#!/usr/bin/env bash
# The transformer measurements on one GPU, in parts of under ten minutes
# each, with TensorFlow staged per ../shared/gpu/README.md (source /tmp/tf-env.sh):
#   A  ViT-B/16 batch 256: torch.compile, kvram without checkpointing, with a
#      full Checkpoint per block, with save_dots per block, PyTorch eager
#   B  the buffers live at the peak of kvram's compiled ViT step without
#      checkpointing; ResNet50 batch 256 against torch.compile
#   C  the buffers live at the peak of the ViT configuration named third (for example
#      kvram_cudnn_ckpt: what a full Checkpoint per block still holds)
#   D  ViT-B/16 with keras.layers.MultiHeadAttention in kvram's model
#   E  ViT-B/16 with kvram.speed.lean_activations
#   G  the README's usage (kvram's defaults: import kvram's pinning, steps_per_execution
#      "auto") on ResNet50 against torch.compile and the hand-tuned configuration
#   H  the same on ViT-B/16
#   I  issue 34's ViT-B/16 bars in one call: torch.compile, the lean step without and with a
#      Checkpoint on 11 and on 10 of the 12 blocks, XLA without excess precision (160 steps after 40)
#   I2 the same with a Checkpoint on all 12 blocks, beside torch.compile again
#   J  ResNet50 against torch.compile, with and without excess precision, and without conv biases
#      (torchvision's architecture; 320 steps after 80)
#   J2 issue 34's ResNet50 bar alone: torch.compile and kvram on torchvision's architecture (no conv
#      biases), 320 steps after 80 (about 3.5 minutes)
#   K  kvram's cuDNN attention with XLA's cuDNN attention passes on (--xla_gpu_enable_cudnn_fmha):
#      first the GPU test of its outputs and gradients against Keras's attention, then ViT-B
#   F  one configuration of the GPT-2-medium-shaped decoder, named third (KerasHub;
#      wheels in .gpu/hub: keras-hub, regex, tokenizers, carried with the call); its compilation takes minutes
#   F2 issue 34's decoder bar in one call: plain Keras bf16 and kvram's model with the XLA flags
#      `import kvram` adds, 32 steps after 16 (about 7 minutes)
# Each configuration writes OUT/<bench>_<config>.json as it finishes.
#   bash benchmarks/transformers_gpu.sh A "$OUT"
# Issue 34's bars from one machine start (each call right after the last: an idle machine is
# released in about 30 s): the install call with part I, then J2, then F2 (its call carries .gpu/hub).
set -u
part=$1
out=$2
source /tmp/tf-env.sh || exit 1
# shares autotuning results between the configurations' processes (shorter compiles)
export TF_CPP_MIN_LOG_LEVEL=2 XLA_FLAGS=--xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla_at
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
vit() { for c in "$@"; do timeout 200 python benchmarks/vit/bench.py --only "$c" --out "$out/vit_$c.json"; done; }
case $part in
A) vit torch_fp16_compile kvram_nockpt_pin_spe16 kvram_pin_spe16 kvram_dots_pin_spe16 torch_fp16 ;;
B) rm -rf /tmp/dump
   XLA_FLAGS="$XLA_FLAGS --xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" timeout 200 \
     python benchmarks/vit/bench.py --only kvram_nockpt_pin_spe16 --steps 16 --warmup 16 --out "$out/vit_dumped_kvram_nockpt_pin_spe16.json"
   python benchmarks/profile/xla_buffers.py /tmp/dump --out "$out/vit_buffers_kvram_nockpt_pin_spe16.json" | head -40
   for c in torch_fp16_compile kvram_fp16_pin_spe16; do
     timeout 150 python benchmarks/resnet50/bench.py --only "$c" --out "$out/resnet50_$c.json"
   done
   ;;
C) rm -rf /tmp/dump
   XLA_FLAGS="$XLA_FLAGS --xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" timeout 300 \
     python benchmarks/vit/bench.py --only "$3" --steps 16 --warmup 16 --out "$out/vit_dumped_$3.json"
   python benchmarks/profile/xla_buffers.py /tmp/dump --out "$out/vit_buffers_$3.json" | head -40
   ;;
D) vit kvram_mha_nockpt_pin_spe16 kvram_mha_dots_pin_spe16 ;;
E) vit kvram_lean_nockpt_pin_spe16 kvram_lean_dots_pin_spe16 ;;
G) for c in torch_fp16_compile kvram_default kvram_default_fp16 kvram_fp16_pin_spe16; do
     timeout 150 python benchmarks/resnet50/bench.py --only "$c" --out "$out/resnet50_$c.json"
   done
   ;;
H) vit torch_fp16_compile kvram_default kvram_nockpt_pin_spe16 ;;
I) python benchmarks/vit/bench.py --only torch_fp16_compile --only kvram_cudnn_lean_nockpt_noexcess \
     --only kvram_cudnn_lean_ckpt11_noexcess --only kvram_cudnn_lean_ckpt10_noexcess --out "$out/vit_issue34.json" ;;
I2) python benchmarks/vit/bench.py --only torch_fp16_compile --only kvram_cudnn_lean_ckpt_noexcess \
     --out "$out/vit_issue34_ckpt.json" ;;
J2) python benchmarks/resnet50/bench.py --steps 320 --warmup 80 --only torch_fp16_compile \
     --only kvram_fp16_pin_spe16_cublaslt_nobias --out "$out/resnet50_issue34_bar.json" ;;
K) XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_cudnn_fmha=true" python -m pytest -q -m gpu tests/test_attention.py \
     -k cudnn_attention_equals -p no:cacheprovider || exit 1
   python benchmarks/vit/bench.py --only torch_fp16_compile --only kvram_cudnn_lean_nockpt_noexcess \
     --only kvram_cudnn_lean_nockpt_fmhaflag_noexcess --out "$out/vit_fmhaflag.json" ;;
J) python benchmarks/resnet50/bench.py --steps 320 --warmup 80 --only torch_fp16_compile \
     --only kvram_fp16_pin_spe16_cublaslt --only kvram_fp16_pin_spe16_cublaslt_noexcess \
     --only kvram_fp16_pin_spe16_cublaslt_nobias --out "$out/resnet50_issue34.json" ;;
F|F2) python3 -c "import regex, tokenizers" 2>/dev/null || echo "regex/tokenizers from .gpu/hub"
   python3 -m pip install -q --no-index --no-deps --target /tmp/hub .gpu/hub/*.whl
   export PYTHONPATH=$PYTHONPATH:/tmp/hub
   if [ "$part" = F ]; then
     timeout 560 python benchmarks/decoder/bench.py --only "$3" --warmup 2 --steps 6 --out "$out/decoder_$3.json"
   else
     python benchmarks/decoder/bench.py --only keras_bf16 --only kvram_model_attention_lean_chunk1024_xlaflags \
       --warmup 16 --steps 32 --out "$out/decoder_issue34.json"
   fi
   ;;
esac
ls "$out"
