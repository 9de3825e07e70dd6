#!/usr/bin/env python3
"""Peer row for kvc_cuda_bench: PyTorch scaled_dot_product_attention fp16 decode on the same shapes.

One query token per sequence, 8 KV heads, head dim 128, GQA 1 and 4, T = 4k/32k/128k, batch 1 and 16.
Timing: CUDA events over repeated calls after a warm-up. bytes_per_second counts the fp16 K and V read
(the same convention as kvc's rows). Run on the GPU machine: python3 benchmarks/cuda/sdpa_decode.py
"""
import argparse

import torch
import torch.nn.functional as F


def time_call(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    args = ap.parse_args()
    kv_heads, d = 8, 128
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for T in args.tokens:
        for B in args.batches:
            for G in (1, 4):
                q = torch.randn(B, kv_heads * G, 1, d, device="cuda", dtype=torch.float16)
                k = torch.randn(B, kv_heads, T, d, device="cuda", dtype=torch.float16)
                v = torch.randn_like(k)
                if G == 1:
                    fn = lambda: F.scaled_dot_product_attention(q, k, v)
                else:
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                sec = time_call(fn, args.iters)
                read = 2 * k.numel() * k.element_size()
                print(f"SDPA/fp16/T:{T}/B:{B}/G:{G}  time_us={sec * 1e6:.1f}  "
                      f"bytes_per_second={read / sec / 1e9:.1f}G  read_MB={read / 1e6:.1f}")
                del q, k, v
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
