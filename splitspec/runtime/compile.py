"""--enable-torch-compile: the model's forward compiled by torch.compile (inductor), as SGLang does it.

What is compiled is everything between the attention calls: embeddings, norms, projections, SwiGLU,
the residual adds and, for heads, the feature projection. Inductor fuses the pointwise work (norm +
residual, SiLU-and-mul, casts) into a few generated kernels per layer. Attention stays one opaque
custom op (`splitspec::attention`, as vLLM's unified attention op): it reads the batch's attention
backend, plan and RoPE from a context the caller sets outside the compiled code, so the compiled graph
depends only on its tensors' shapes, never on a batch's paged layout, and one graph serves every batch
of the same token count. Inside compiled code the norms and activations take their torch twins (SGLang's
forward_native under compile); attention, outside it, keeps its Triton/FlashInfer kernels.

Shapes are static (dynamic=False, as SGLang): a batch of T new tokens compiles once, on its first call
(the compile time is logged and kept in `compile_seconds`); with CUDA graphs the compiled forward is what
each graph captures. --torch-compile-max-bs bounds which batches use it (uniform batches of at most that
many requests: decode steps, tree verification, draft steps); others run the eager model.
SPLITSPEC_TORCH_COMPILE_MODE picks inductor's mode (default SGLang's: max-autotune-no-cudagraphs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODE = "max-autotune-no-cudagraphs"
_CONTEXT: list[tuple[object, object, object]] = []  # (backend, plan, rope) of the forward being run


@torch.library.custom_op("splitspec::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 layer_id: int) -> torch.Tensor:
    """RoPE, the KV write and attention of one layer, by the backend of the current forward."""
    backend, plan, rope = _CONTEXT[-1]
    return backend.run_rope(layer_id, q, k, v, plan, rope, positions)


@attention_op.register_fake
def _(q, k, v, positions, layer_id):
    return q.new_empty(q.shape)


class OpaqueAttention:
    """The backend a compiled forward sees: each layer's attention is the custom op."""

    def run_rope(self, layer_id: int, q, k, v, plan, rope, positions):
        return attention_op(q, k, v, positions, layer_id)


OPAQUE = OpaqueAttention()


@contextlib.contextmanager
def attention_context(backend, plan, rope):
    _CONTEXT.append((backend, plan, rope))
    try:
        yield
    finally:
        _CONTEXT.pop()


class CompiledForward:
    """model(input_ids, positions, backend, plan, capture_layers, **extra) through torch.compile."""

    def __init__(self, model: torch.nn.Module, max_bs: int, mode: str | None = None):
        import torch._dynamo

        self.model, self.max_bs = model, max_bs
        self.mode = mode or os.environ.get("SPLITSPEC_TORCH_COMPILE_MODE", DEFAULT_MODE)
        # one graph per token count (and per caller: target steps, draft steps), more than dynamo's default 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)
        self.fn = torch.compile(model, dynamic=False, mode=self.mode)
        self.compile_seconds: dict[tuple, float] = {}  # shape key -> seconds of its first (compiling) call
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, plan,
                 capture_layers: tuple[int, ...] = (), **extra):
        key = (input_ids.shape[0], tuple(capture_layers),
               *((name, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for name, v in sorted(extra.items())))
        first = key not in self.compile_seconds
        start = time.perf_counter()
        with attention_context(backend, plan, self.model.rotary_emb):
            out = self.fn(input_ids, positions, OPAQUE, None, capture_layers, **extra)
        self.calls += 1
        if first:
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            self.compile_seconds[key] = time.perf_counter() - start
            logger.info("torch.compile (%s): forward of %d tokens compiled in %.1f s", self.mode, input_ids.shape[0],
                        self.compile_seconds[key])
        return out

    @property
    def total_compile_seconds(self) -> float:
        return sum(self.compile_seconds.values())
