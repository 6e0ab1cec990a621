"""Triton kernel (CUDA only): a batch of tree verifications' attention masks packed to bits on the device, in the
layout FlashInfer's custom-mask attention reads (kernels.torch_ops.tree_mask_bits is its twin).

A CUDA graph of a tree verification runs it before its layers, so the host hands over each request's ancestor
bits (a few ints) instead of packing its whole mask, prefix included, bit by bit (~5 us a request in Python).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512  # bytes a program packs


@triton.jit
def _tree_mask_kernel(kv_ptr, offset_ptr, anc_ptr, out_ptr, Q: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    start = tl.load(offset_ptr + r)
    end = tl.load(offset_ptr + r + 1)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # bytes of request r's mask
    live = start + j < end
    kv = tl.load(kv_ptr + r)
    prefix = kv - Q
    byte = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(8):
        e = j * 8 + k  # element (i, c) of the request's [Q, kv] mask, row-major
        i = e // kv
        c = e - i * kv
        d = c - prefix  # the key's node in the tree (< 0: the cached prefix, always visible)
        tree = d >= 0
        dd = tl.where(tree, d, 0)
        row = tl.minimum(i, Q - 1)
        word = tl.load(anc_ptr + (r * Q + row) * W + dd // 16, mask=live & tree & (i < Q), other=0)
        bit = tl.where(tree, (word >> (dd % 16)) & 1, 1)
        bit = tl.where(i < Q, bit, 0)
        byte = byte | (bit << k)
    tl.store(out_ptr + start + j, byte.to(tl.uint8), mask=live)


def tree_mask_bits(kv_lens: torch.Tensor, byte_offsets: torch.Tensor, ancestors: torch.Tensor, out: torch.Tensor) -> None:
    requests, q, words = ancestors.shape
    per_request = out.numel() // requests  # the most bytes a request's mask may take
    grid = (requests, triton.cdiv(per_request, BLOCK))
    _tree_mask_kernel[grid](kv_lens, byte_offsets, ancestors, out, Q=q, W=words, BLOCK=BLOCK)
