"""Dispatch: the Triton kernel for CUDA tensors when Triton imports, else the torch twin.
SPLITSPEC_KERNELS=torch forces the twins everywhere (to compare, or to rule the kernels out)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from splitspec.kernels import torch_ops

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton():
    if os.environ.get("SPLITSPEC_KERNELS", "auto") == "torch":
        return None
    try:
        from splitspec.kernels import triton_ops
    except Exception:  # noqa: BLE001 (no triton, or no GPU toolchain: the twins serve)
        return None
    return triton_ops


_twins_forced = 0


@contextlib.contextmanager
def twins():
    """The torch twins inside this block, whatever the device (to compare a path's speed or output with them)."""
    global _twins_forced
    _twins_forced += 1
    try:
        yield
    finally:
        _twins_forced -= 1


def triton_ready() -> bool:
    """Whether the Triton kernels can run here (Triton imports and SPLITSPEC_KERNELS is not torch)."""
    return _triton() is not None


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors outside autograd (the kernels have no backward; the head trainer gets the twins; the engine's
    step turns autograd off: Engine.step), outside torch.compile (inductor fuses the twins itself: runtime.compile)
    and outside twins()."""
    return (x.is_cuda and not torch.is_grad_enabled() and not _twins_forced
            and not torch.compiler.is_compiling() and _triton() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x) and weight.dtype == x.dtype:
        return _triton().rms_norm(x, weight, eps)
    return torch_ops.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x) and weight.dtype == x.dtype == residual.dtype:
        return _triton().add_rms_norm(x, residual, weight, eps)
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """[rms_norm(a), rms_norm(b)] concatenated on the last dim: one kernel on a GPU (the twin takes three)."""
    if use_triton(a) and a.shape == b.shape and a.dtype == b.dtype == weight_a.dtype == weight_b.dtype:
        return _triton().rms_norm_pair(a, weight_a, b, weight_b, eps)
    return torch_ops.rms_norm_pair(a, weight_a, b, weight_b, eps)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (float8_e4m3fn [T, K], scale [T, 1] float32): dynamic per-token FP8 quantization of
    activations, one kernel on a GPU (the twin takes seven)."""
    if use_triton(x) and x.shape[-1] > 0:
        return _triton().quantize_fp8_per_token(x)
    return torch_ops.quantize_fp8_per_token(x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return _triton().silu_and_mul(gate_up)
    return torch_ops.silu_and_mul(gate_up)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
               positions: torch.Tensor, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q) and cos_cache.dtype == torch.float32:
        from splitspec.kernels import triton_rope

        return triton_rope.apply_rope(q, k, cos_cache, sin_cache, positions, rot_dim)
    return torch_ops.apply_rope(q, k, cos_cache, sin_cache, positions, rot_dim)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   positions: torch.Tensor, rot_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, k and v stored into the paged cache at their slots, in one kernel on a GPU; returns q."""
    if use_triton(q) and cos_cache.dtype == torch.float32 and k_cache.dtype == k.dtype == v.dtype and k_cache.is_contiguous():
        from splitspec.kernels import triton_rope

        return triton_rope.rope_and_store(q, k, v, cos_cache, sin_cache, positions, rot_dim, k_cache, v_cache, slots)
    return torch_ops.rope_and_store(q, k, v, cos_cache, sin_cache, positions, rot_dim, k_cache, v_cache, slots)


def move_kv_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Rows src -> dst of every plane of pool [planes, num_slots, width] (the KV cache's compaction of
    accepted tree nodes: one launch for every layer and every request of a step)."""
    if src.numel() == 0:
        return
    if use_triton(pool) and pool.is_contiguous():
        return _triton().move_kv_slots(pool, src, dst)
    torch_ops.move_kv_slots(pool, src, dst)


def verify_tree_greedy(candidates: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor,
                       max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a batch of padded trees on the device (kernels.torch_ops.verify_tree_greedy)."""
    if use_triton(candidates) and candidates.is_contiguous() and parents.is_contiguous() and targets.is_contiguous():
        return _triton().verify_tree_greedy(candidates, parents, targets, max_depth)
    return torch_ops.verify_tree_greedy(candidates, parents, targets, max_depth)


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Position-keyed Gumbel-max sample of each row of logits [B, V] fp32 (keys: sampling.position_keys)."""
    if use_triton(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return _triton().gumbel_argmax(logits, keys)
    return torch_ops.gumbel_argmax(logits, keys)


def chain_acceptance(targets: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """Verified chains' accepted drafts, accepted rows and lengths after acceptance, [3, B], in one kernel
    (kernels.torch_ops.chain_acceptance: five ops there)."""
    if use_triton(targets) and all(t.is_contiguous() for t in (targets, input_ids, lengths)):
        return _triton().chain_acceptance(targets, input_ids, lengths, n)
    return torch_ops.chain_acceptance(targets, input_ids, lengths, n)


def draft_topk(logits: torch.Tensor, parent_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens and their probabilities times the row's parent score (a draft step's
    candidates: kernels.torch_ops.draft_topk). Ties: the kernel takes the lower token id first."""
    if parent_scores.numel() != logits.shape[0]:  # the kernel reads one a row (the twin would broadcast one)
        raise ValueError(f"draft_topk: {parent_scores.numel()} parent scores for {logits.shape[0]} rows of logits")
    if use_triton(logits) and logits.dtype in FLOATS and logits.stride(-1) == 1:  # read as float32 in the kernel
        return _triton().draft_topk(logits, parent_scores, k)
    return torch_ops.draft_topk(logits, parent_scores, k)


def top_k_top_p(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k and top-p (SGLang's order) on logits [B, V] fp32: kernels.torch_ops.top_k_top_p."""
    if use_triton(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return _triton().top_k_top_p(logits, temperatures, top_ks, top_ps)
    return torch_ops.top_k_top_p(logits, temperatures, top_ks, top_ps)


def accept_tree_coins(candidates: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
                      probs: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor, threshold_single: float,
                      threshold_acc: float, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's threshold acceptance of a batch of padded trees with the bonus draw, on the device
    (kernels.torch_ops.accept_tree_coins)."""
    if use_triton(probs):
        return _triton().accept_tree_coins(candidates, next_token, next_sibling, probs, coins, final_coins,
                                           threshold_single, threshold_acc, max_depth)
    return torch_ops.accept_tree_coins(candidates, next_token, next_sibling, probs, coins, final_coins,
                                       threshold_single, threshold_acc, max_depth)


def tree_mask_bits(kv_lens: torch.Tensor, byte_offsets: torch.Tensor, ancestors: torch.Tensor, out: torch.Tensor) -> None:
    """A batch of tree verifications' attention masks packed to bits into out (kernels.torch_ops.tree_mask_bits)."""
    if use_triton(out) and all(t.is_contiguous() for t in (kv_lens, byte_offsets, ancestors, out)):
        from splitspec.kernels import triton_tree_mask

        return triton_tree_mask.tree_mask_bits(kv_lens, byte_offsets, ancestors, out)
    torch_ops.tree_mask_bits(kv_lens, byte_offsets, ancestors, out)


def shift_paged_inputs(shift: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor, kv_indptr: torch.Tensor,
                       page_ids: torch.Tensor, out_slots: torch.Tensor, q: int, page_size: int) -> None:
    """A paged graph's key counts, positions and K/V slots moved back by shift on the device, in place
    (kernels.torch_ops.shift_paged_inputs; runtime.batch_shift)."""
    if use_triton(shift) and all(t.is_contiguous() for t in (shift, kv_lens, positions, kv_indptr, page_ids, out_slots)):
        from splitspec.kernels import triton_batch_shift

        return triton_batch_shift.shift_paged_inputs(shift, kv_lens, positions, kv_indptr, page_ids, out_slots, q,
                                                     page_size)
    torch_ops.shift_paged_inputs(shift, kv_lens, positions, kv_indptr, page_ids, out_slots, q, page_size)


def merge_own_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out_prefix: torch.Tensor,
                        lse_prefix: torch.Tensor, scale: float) -> torch.Tensor:
    """A draft node's attention over its own keys [R, J, Hkv, D] merged with its attention over the committed ones
    (out_prefix [R, Hq, D], lse_prefix [R, Hq] fp32, natural log): kernels.torch_ops.merge_own_attention."""
    if use_triton(q) and lse_prefix.dtype == torch.float32 \
            and all(t.stride(-1) == 1 for t in (q, keys, values, out_prefix, lse_prefix)):
        from splitspec.kernels import triton_own_attention

        return triton_own_attention.merge_own_attention(q, keys, values, out_prefix, lse_prefix, scale)
    return torch_ops.merge_own_attention(q, keys, values, out_prefix, lse_prefix, scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, qo: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_lens: torch.Tensor, page_ids: torch.Tensor, ancestors: torch.Tensor | None,
                    mode: int, scale: float, max_rows: int, work: tuple | None = None, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, min_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A few query rows a request over its keys in the paged cache, no host plan (kernels.torch_ops.paged_attention;
    the Triton kernel needs `work`: triton_paged_attention.shared_scratch's buffers and the splits; min_chunk: its
    least keys a split, None for its default)."""
    if use_triton(q) and work is not None and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1:
        from splitspec.kernels import triton_paged_attention

        return triton_paged_attention.paged_attention(q, k_cache, v_cache, page_size, qo, kv_indptr, kv_lens, page_ids,
                                                      ancestors, mode, scale, max_rows, work, out, lse, min_chunk)
    return torch_ops.paged_attention(q, k_cache, v_cache, page_size, qo, kv_indptr, kv_lens, page_ids, ancestors, mode,
                                     scale, out, lse)
