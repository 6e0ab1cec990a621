"""Triton kernels for the hot paths of a forward, each with a torch twin that computes the same thing.

    rms_norm(x, weight, eps)                    x / rms(x) * weight (HF's order: fp32 norm, cast, times weight)
    add_rms_norm(x, residual, weight, eps)      residual += x (in x's dtype); returns (rms_norm(residual), residual)
    rms_norm_pair(a, weight_a, b, weight_b, eps)
                                                [rms_norm(a), rms_norm(b)] side by side (an EAGLE-3 or MTP head's input)
    silu_and_mul(gate_up)                       silu(gate) * up of a fused [T, 2I] projection
    apply_rope(q, k, cos_cache, sin_cache, positions, rot_dim)
                                                NeoX rotation of q [T, Hq, D] and k [T, Hkv, D] at positions
    rope_and_store(q, k, v, cos_cache, sin_cache, positions, rot_dim, k_cache, v_cache, slots)
                                                apply_rope, k and v written into the paged cache at slots; returns q
    move_kv_slots(pool, src, dst)               the KV compaction of accepted tree nodes, every layer in one launch
    verify_tree_greedy(...)                     greedy tree acceptance of a batch of padded trees
    accept_tree_coins(...)                      SGLang's threshold rule for a batch of trees, with the bonus draw
    gumbel_argmax(logits, keys)                 position-keyed Gumbel-max sampling (the bonus/plain token)
    top_k_top_p(logits, temps, top_ks, top_ps)  temperature, top-k, top-p (threshold search, no sort)
    draft_topk(logits, parent_scores, k)        a draft step's softmax + top-k, scored by the parent beam
    quantize_fp8_per_token(x)                   FP8 e4m3 activations with one dynamic scale per row (W8A8 layers)
    tree_mask_bits(kv_lens, offsets, ancestors, out)
                                                tree verifications' attention masks packed to bits (FlashInfer's)
    merge_own_attention(q, keys, values, out_prefix, lse_prefix, scale)
                                                a draft node's attention over its own keys, merged with the prefix's
    paged_attention(q, k_cache, v_cache, page_size, qo, kv_indptr, kv_lens, page_ids, ancestors, mode, scale, ...)
                                                a few query rows a request over the paged cache (trees, chains, beams)
    shift_paged_inputs(shift, kv_lens, positions, kv_indptr, page_ids, out_slots, q, page_size)
                                                a paged graph's key counts, positions and K/V slots moved back in place

On a CUDA tensor with Triton importable the Triton kernel runs; otherwise (CPU, or SPLITSPEC_KERNELS=torch)
the twin does. Twins are the reference: tests/kernel_checks.py compares the two, on a GPU
(tests/test_gpu_kernels.py) and on CPU under Triton's interpreter (tests/test_kernels_interpreted.py).
"""

from __future__ import annotations

from splitspec.kernels.ops import (accept_tree_coins, add_rms_norm, apply_rope, chain_acceptance, draft_topk, gumbel_argmax,
                                   merge_own_attention, move_kv_slots, paged_attention, quantize_fp8_per_token, rms_norm,
                                   rms_norm_pair, rope_and_store, shift_paged_inputs, silu_and_mul, top_k_top_p,
                                   tree_mask_bits, twins, use_triton, verify_tree_greedy)

__all__ = ["accept_tree_coins", "add_rms_norm", "apply_rope", "chain_acceptance", "draft_topk", "gumbel_argmax",
           "merge_own_attention", "move_kv_slots", "paged_attention", "quantize_fp8_per_token", "rms_norm", "rms_norm_pair",
           "rope_and_store", "shift_paged_inputs", "silu_and_mul", "top_k_top_p", "tree_mask_bits", "twins", "use_triton",
           "verify_tree_greedy"]
