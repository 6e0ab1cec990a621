"""The reference attention backend: gathers each request's keys from the paged cache, pads the batch
and calls torch's scaled_dot_product_attention with an explicit boolean mask. It is the CPU path and
the reference every faster backend is tested against.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitspec.runtime.attention.base import AttentionBackend, AttentionBatch
from splitspec.runtime.kv_cache import slot_ids


@dataclass
class TorchPlan:
    out_slots: torch.Tensor  # [T] where new K/V go
    kv_slots: torch.Tensor  # [B, max_kv] flat slot of each key (padding -> slot 0, masked)
    masks: dict  # window (None = full) -> [B, 1, max_q, max_kv] bool
    row_request: torch.Tensor  # [T] request of each new token
    row_offset: torch.Tensor  # [T] its index among that request's new tokens
    max_q: int


def build_masks(batch: AttentionBatch, windows: set, device: torch.device) -> dict:
    """window -> [B, 1, max_q, max_kv] bool: prefix visible, new tokens by mask/causal, window applied.

    Padded query rows see key 0 only (their output is discarded) so no row is fully masked.
    """
    num_requests, max_q, max_kv = batch.num_requests, max(batch.q_lens), max(batch.kv_lens)
    base = torch.zeros(num_requests, max_q, max_kv, dtype=torch.bool)
    q_pos = torch.zeros(num_requests, max_q, dtype=torch.long)
    k_pos = torch.zeros(num_requests, max_kv, dtype=torch.long)
    start = 0
    positions = batch.positions.cpu()
    for i, (q_len, kv_len, mask) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.masks)):
        prefix = kv_len - q_len
        new = torch.ones(q_len, q_len, dtype=torch.bool).tril() if mask is None else mask.to("cpu", torch.bool)
        base[i, :q_len, :prefix] = True
        base[i, :q_len, prefix:kv_len] = new
        base[i, q_len:, 0] = True
        q_pos[i, :q_len] = positions[start : start + q_len]
        k_pos[i, :prefix] = torch.arange(prefix)
        k_pos[i, prefix:kv_len] = positions[start : start + q_len]
        start += q_len
    masks = {}
    for window in windows:
        mask = base
        if window is not None:
            in_window = (q_pos[:, :, None] - k_pos[:, None, :]) < window
            mask = base & in_window
            mask[:, :, 0] |= ~mask.any(-1)  # keep padded rows non-empty
        masks[window] = mask.unsqueeze(1).to(device)
    return masks


# On a GPU, torch may pick cuDNN's attention for a boolean mask, which builds a graph for every new
# shape: tens of milliseconds of CPU each time the batch's longest key length changes (every decode
# step). The memory-efficient kernel takes any mask with no per-shape setup; math is the fallback.
_CUDA_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: AttentionBatch) -> TorchPlan:
        device = self.kv_cache.device
        page_size = self.kv_cache.page_size
        max_kv = max(batch.kv_lens)
        kv_slots = torch.zeros(batch.num_requests, max_kv, dtype=torch.long)
        for i, (kv_len, pages) in enumerate(zip(batch.kv_lens, batch.page_tables)):
            kv_slots[i, :kv_len] = slot_ids(pages, page_size, 0, kv_len)
        q_lens = torch.tensor(batch.q_lens)
        row_request = torch.repeat_interleave(torch.arange(batch.num_requests), q_lens)
        cu = torch.cumsum(q_lens, 0) - q_lens
        row_offset = torch.arange(int(q_lens.sum())) - cu[row_request]
        return TorchPlan(
            out_slots=batch.out_slots.to(device),
            kv_slots=kv_slots.to(device),
            masks=build_masks(batch, set(self.config.sliding_windows), device),
            row_request=row_request.to(device),
            row_offset=row_offset.to(device),
            max_q=max(batch.q_lens),
        )

    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TorchPlan) -> torch.Tensor:
        k_flat, v_flat = self.kv_cache.flat_kv(layer_id)
        k_flat[plan.out_slots] = k.to(k_flat.dtype)
        v_flat[plan.out_slots] = v.to(v_flat.dtype)
        keys = k_flat[plan.kv_slots].transpose(1, 2)  # [B, Hkv, max_kv, D]
        values = v_flat[plan.kv_slots].transpose(1, 2)
        num_requests = plan.kv_slots.shape[0]
        queries = q.new_zeros(num_requests, plan.max_q, q.shape[1], q.shape[2])
        queries[plan.row_request, plan.row_offset] = q
        with sdpa_kernel(_CUDA_SDPA) if q.is_cuda else nullcontext():
            out = F.scaled_dot_product_attention(
                queries.transpose(1, 2),  # [B, Hq, max_q, D]
                keys,
                values,
                attn_mask=plan.masks[self.config.sliding_windows[layer_id]],
                scale=self.scaling,
                enable_gqa=True,
            )
        return out.transpose(1, 2)[plan.row_request, plan.row_offset]  # [T, Hq, D]

    # cascade attention ---------------------------------------------------------------------------------
    def plan_prefix(self, kv_lens: list[int], page_tables: list[list[int]], q_lens: list[int],
                    state: object = None) -> TorchPrefixPlan:
        kv_lens = [n for n, q in zip(kv_lens, q_lens) for _ in range(q)]  # one entry per row
        page_tables = [t for t, q in zip(page_tables, q_lens) for _ in range(q)]
        device = self.kv_cache.device
        max_kv = max(kv_lens)
        kv_slots = torch.zeros(len(kv_lens), max_kv, dtype=torch.long)
        for i, (kv_len, pages) in enumerate(zip(kv_lens, page_tables)):
            kv_slots[i, :kv_len] = slot_ids(pages, self.kv_cache.page_size, 0, kv_len)
        valid = torch.arange(max_kv)[None, :] < torch.tensor(kv_lens)[:, None]
        return TorchPrefixPlan(kv_slots.to(device), valid.to(device))

    def attend_prefix(self, layer_id: int, q: torch.Tensor, plan: TorchPrefixPlan) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.sliding_windows[layer_id] is not None:
            raise NotImplementedError("prefix attention under a sliding window")
        k_flat, v_flat = self.kv_cache.flat_kv(layer_id)
        return dense_attention(q, k_flat[plan.kv_slots], v_flat[plan.kv_slots], plan.valid, self.scaling)


@dataclass
class TorchPrefixPlan:
    kv_slots: torch.Tensor  # [R, max_kv] flat slot of each key of each row (padding -> slot 0)
    valid: torch.Tensor  # [R, max_kv] bool


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's own keys: q [R, Hq, D], keys/values [R, J, Hkv, D], valid [R, J] bool (None: all) ->
    (output [R, Hq, D], natural-log sum of exp [R, Hq] fp32), in fp32, grouped-query heads shared."""
    rows, num_heads, dim = q.shape
    num_kv = keys.shape[2]
    qg = q.float().view(rows, num_kv, num_heads // num_kv, dim)
    scores = torch.einsum("rhgd,rjhd->rhgj", qg, keys.float()) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("rhgj,rjhd->rhgd", torch.exp(scores - lse[..., None]), values.float())
    return out.reshape(rows, num_heads, dim).to(q.dtype), lse.reshape(rows, num_heads)
