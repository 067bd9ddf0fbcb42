"""Which attention kernels PyTorch runs for ViT-B/16's attention, and with which cuDNN.

One fp16 `scaled_dot_product_attention` forward and backward at ViT-B/16's shape
(batch 256, 12 heads, 197 tokens, head size 64), profiled after three warm-up
calls; prints JSON with torch's version, the cuDNN it loaded, `LD_LIBRARY_PATH`
and the names of the attention kernels that ran. PyTorch picks cuDNN's SDPA or
FlashAttention-2 here depending on the cuDNN it finds (its bundled 9.19, or an
older one first on `LD_LIBRARY_PATH`), which moved `torch_fp16_compile`'s ViT-B
speed by 9% (benchmarks/results/torch_cudnn_env_h200.json). Run it with and
without TensorFlow's staged environment on the GPU machine:

    python3 benchmarks/profile/sdpa_backend.py
    (source /tmp/tf-env.sh; python3 benchmarks/profile/sdpa_backend.py)
"""

import json
import os

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def main():
    q = torch.randn(256, 12, 197, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
        torch.cuda.synchronize()
    words = ("flash", "sdpa", "fmha", "attention")
    kernels = sorted({e.name[:90] for e in p.events()
                      if e.device_type.name == "CUDA" and any(w in e.name.lower() for w in words)})
    print(json.dumps({
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),  # raises where it loaded another cuDNN than its own
        "cuda": torch.version.cuda,
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
        "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
        "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),
        "attention_kernels": kernels,
    }, indent=1))


if __name__ == "__main__":
    main()
