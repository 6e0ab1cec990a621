"""Command-line flags shared by every command that stands up a model (SGLang's names).

Services add their own flags; the model/runtime group is defined once here and turned into a frozen
RuntimeConfig at the edge.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from splitspec.log_format import LOG_LEVELS  # noqa: F401 (for callers)
from splitspec.runtime.attention import ATTENTION_BACKENDS, SGLANG_ATTENTION_BACKENDS
from splitspec.runtime.config import DTYPES, LOAD_FORMATS
from splitspec.runtime.hub import resolve_model_dir

if TYPE_CHECKING:  # the flags parse without torch (`splitspec bench --url` never imports it); runtime_config imports it
    from splitspec.runtime.runner import RuntimeConfig

logger = logging.getLogger("splitspec")
# --piecewise-cuda-graph-max-tokens' default (runtime/piecewise_graph.py)
DEFAULT_PIECEWISE_MAX_TOKENS = 512
# --prompt-cuda-graph-max-tokens' default (runtime/prompt_graph.py); on an H100 (docs/performance.md, 2026-12-05) an
# arrival's 128-token prompt step into a batch of 16 took 0.74 ms against 1.93 eager, a batch-1 request's prompt step
# 0.8-1.0 ms against 2.8-3.4
DEFAULT_PROMPT_GRAPH_MAX_TOKENS = 512
# what a GPU torch can use leaves on the host: NVIDIA's driver, ROCm's (HIP answers torch.cuda), WSL's
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def on_gpu(device: str | None) -> bool:
    """Whether a --device value (None or auto: cuda when available) names a GPU. auto asks torch, unless no GPU
    driver is on the host: then it is False without importing torch (an NGRAM drafter process never does;
    `splitspec bench --url` neither)."""
    device = str(device or "auto")
    if device == "auto":
        if "torch" not in sys.modules and not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
            return False
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model-path", "--model", dest="model_path", default=None,
        help="HF-format model directory (config.json + safetensors), or a hub id org/name resolved "
        "through huggingface_hub (its cache; HF_HUB_OFFLINE=1 works offline). Default: the demo target "
        "(see `splitspec demo-models`).",
    )
    group.add_argument("--revision", default=None, help="Hub branch, tag or commit of --model-path (default: main).")
    group.add_argument(
        "--load-format", default="auto", choices=LOAD_FORMATS,
        help="auto: safetensors, else pytorch_model.bin; safetensors or pt (pytorch_model.bin, loaded weights-only): only "
        "that format; dummy: random weights from config.json alone; dummy-decisive: the same, made decisive (the current "
        "token wins each step by a wide margin whatever the rounding: greedy outputs that hold between batch shapes, "
        "for simulated speculation, --speculative-replay; same shapes and kernels, so the same cost).",
    )
    group.add_argument(
        "--dtype", default="auto", choices=("auto", *DTYPES),
        help="Weight and activation dtype; auto = the checkpoint's (fp32 checkpoints run in bf16 on GPU).",
    )
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N; auto = cuda when available.")
    group.add_argument("--cpu-wide-forward-threads", type=int, default=0,
                       help="On a CPU device: torch threads for the model's forwards (prompt chunks and decode steps); the "
                       "process's other torch work keeps its count (OMP_NUM_THREADS). 0: one count for all. `splitspec up` "
                       "sets it to the machine's cores when it plans the services' threads (the verifier's own count "
                       "leaves a core to the gateway and the drafters; a forward is compute that gains from every core).")
    group.add_argument("--random-seed", type=int, default=0, help="Seed of --load-format dummy weights.")
    group.add_argument("--quantization", default=None,
                       help="Weight quantization of the target (SGLang's flag). fp8: the linear layers of every decoder "
                       "layer (q/k/v, o, gate/up, down) hold float8_e4m3fn weights with a float32 scale per output "
                       "channel; a bf16/fp16/fp32 checkpoint is quantized as it loads, an FP8 checkpoint (llm-compressor "
                       "/ vLLM layout: F8_E4M3 weights with per-tensor or per-channel weight_scale) loads as stored; "
                       "embeddings, norms and lm_head stay in --dtype. On CUDA GPUs of compute capability >= 8.9 the "
                       "matmuls are W8A8 (torch._scaled_mm, activations quantized per token on the fly); elsewhere "
                       "weight-only (FP8 weights dequantized to --dtype). unquant: load unquantized (an FP8 checkpoint "
                       "is then refused). Default: unquantized, unless config.json's quantization_config names an FP8 "
                       "checkpoint (detected and logged). SGLang's other methods (awq, gptq, bitsandbytes, ...) are "
                       "refused at start with the reason.")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--page-size", type=int, default=16, help="Tokens per KV-cache page.")
    memory.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="KV-cache capacity in tokens for requests; overrides --mem-fraction-static. generate sizes the cache to "
        "its prompts when neither is given; a service on CPU takes four contexts (at most 65536 tokens and a tenth of "
        "the free memory). On a GPU the prompt CUDA graphs' padding requests get their pages on top of it "
        "(--prompt-cuda-graph-max-tokens + 1 tokens).",
    )
    memory.add_argument(
        "--mem-fraction-static", type=float, default=None,
        help="GPU only: fraction of GPU memory for weights plus KV cache (0.85 when the cache is sized from "
        "GPU memory).",
    )
    parser.add_argument(
        "--attention-backend", default="auto", choices=["auto", *sorted({*ATTENTION_BACKENDS, *SGLANG_ATTENTION_BACKENDS})],
        help="Attention kernels: auto (flashinfer on CUDA when the package imports, else torch), flashinfer (CUDA: "
        "paged decode, prefill and tree masks; CUDA graphs), torch (the reference, any device). SGLang's other "
        "names are accepted and served by auto (logged).",
    )
    sglang = parser.add_argument_group("SGLang server flags (accepted so SGLang launch lines run unchanged)")
    sglang.add_argument("--trust-remote-code", action="store_true",
                        help="Accepted: splitspec runs its own code for the architectures it supports and never "
                        "executes code shipped in a checkpoint.")
    sglang.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="Largest decode batch replayed from CUDA graphs (captured at start for 1, 2, 4, 8, then "
                        "every 8; default by the GPU's memory, as SGLang: 256 above 90 GiB, 160 above 20 GiB, else 32). Needs a CUDA device and the flashinfer backend; a logged no-op elsewhere.")
    sglang.add_argument("--disable-cuda-graph", action="store_true", help="Run every step eagerly (no CUDA graphs).")
    sglang.add_argument("--disable-piecewise-cuda-graph", action="store_true",
                        help="Run prompt chunks and mixed steps (a chunk beside decoding requests) eagerly instead of "
                        "replaying piecewise CUDA graphs (captured at start for token counts up to "
                        "--piecewise-cuda-graph-max-tokens; attention runs eagerly between the pieces). On by default "
                        "with CUDA graphs, as in SGLang.")
    sglang.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                        help=f"Largest forward (tokens) replayed from piecewise CUDA graphs (default {DEFAULT_PIECEWISE_MAX_TOKENS}); "
                        "larger prompt chunks run eagerly, where launching costs little against their compute.")
    parser.add_argument("--prompt-cuda-graph-max-tokens", type=int, default=DEFAULT_PROMPT_GRAPH_MAX_TOKENS,
                        help="Steps that only prefill (a request joining a running batch, a wave of arrivals, a long "
                        "prompt's chunks) of up to this many tokens replay whole CUDA graphs, attention included, their "
                        "chunks padded to a captured length (16, 32, 64, ... tokens; captured at start for the batch sizes "
                        f"whose tokens fit; default {DEFAULT_PROMPT_GRAPH_MAX_TOKENS}); a request joining a batch that "
                        "verifies no drafts then prefills alone rather than mixed beside it. 0: off; such steps replay "
                        "piecewise graphs. Needs CUDA graphs (no effect with --disable-cuda-graph or on a CPU).")
    sglang.add_argument("--enable-torch-compile", action="store_true",
                        help="torch.compile (inductor) the model's forward for uniform batches (decode steps, tree "
                        "verification, draft steps) of up to --torch-compile-max-bs requests; attention stays one "
                        "opaque op with its own kernels. Each new token count compiles once, at its first use or "
                        "at CUDA graph capture (logged with its time). SPLITSPEC_TORCH_COMPILE_MODE sets inductor's "
                        "mode (default max-autotune-no-cudagraphs, as SGLang).")
    sglang.add_argument("--torch-compile-max-bs", type=int, default=None,
                        help="Largest batch (requests) the compiled forward serves (default 32); larger batches run "
                        "eagerly.")
    sglang.add_argument("--enable-dp-attention", action="store_true",
                        help="Refused: splitspec has no data-parallel attention, and SGLang's speculative decoding "
                        "does not support it either (STANDALONE, NGRAM).")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")


def check_sglang_server_flags(args: argparse.Namespace, command: str) -> None:
    """Refuse what cannot be honoured, log what is accepted as a no-op, and map SGLang's attention
    backends to an implemented one. Raises ValueError naming the flag."""
    if getattr(args, "enable_dp_attention", False):
        raise ValueError("--enable-dp-attention is not supported: splitspec has no data-parallel attention, and "
                         "speculative decoding does not support it in SGLang either")
    on_cpu = not on_gpu(getattr(args, "device", "auto"))
    if getattr(args, "cuda_graph_max_bs", None) is not None:
        if args.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs {args.cuda_graph_max_bs}: must be at least 1 (--disable-cuda-graph "
                             "turns graphs off)")
        if on_cpu:
            logger.info("%s: --cuda-graph-max-bs %d is a no-op on CPU", command, args.cuda_graph_max_bs)
    if getattr(args, "cpu_wide_forward_threads", 0) < 0:
        raise ValueError(f"--cpu-wide-forward-threads {args.cpu_wide_forward_threads}: must be 0 (off) or more")
    if getattr(args, "piecewise_cuda_graph_max_tokens", None) is not None and args.piecewise_cuda_graph_max_tokens < 1:
        raise ValueError(f"--piecewise-cuda-graph-max-tokens {args.piecewise_cuda_graph_max_tokens}: must be at least 1 "
                         "(--disable-piecewise-cuda-graph turns the graphs off)")
    if getattr(args, "prompt_cuda_graph_max_tokens", 0) < 0:
        raise ValueError(f"--prompt-cuda-graph-max-tokens {args.prompt_cuda_graph_max_tokens}: must be 0 (off) or more")
    if getattr(args, "torch_compile_max_bs", None) is not None:
        if args.torch_compile_max_bs < 1:
            raise ValueError(f"--torch-compile-max-bs {args.torch_compile_max_bs}: must be at least 1")
        if not getattr(args, "enable_torch_compile", False):
            logger.info("%s: --torch-compile-max-bs is a no-op without --enable-torch-compile", command)
    if getattr(args, "trust_remote_code", False):
        logger.info("%s: --trust-remote-code accepted; no checkpoint code is executed", command)
    from splitspec.runtime.quantization import check_method as check_quantization_method

    check_quantization_method(getattr(args, "quantization", None))
    if on_cpu and getattr(args, "attention_backend", "auto") == "flashinfer":
        raise ValueError("--attention-backend flashinfer needs a CUDA device; on CPU use auto or torch")
    if getattr(args, "attention_backend", "auto") not in ("auto", *ATTENTION_BACKENDS):
        logger.warning("%s: --attention-backend %s is not implemented yet; serving with auto (flashinfer on CUDA, "
                       "torch on CPU)", command, args.attention_backend)
        args.attention_backend = "auto"


def resolve_model(args: argparse.Namespace) -> Path:
    """--model-path as a directory; with none given, the default model (splitspec.default_model: the demo
    target, built first if it must be, under the splitspec command)."""
    if args.model_path is None:
        from splitspec.default_model import default_model

        return default_model()
    return resolve_model_dir(args.model_path, args.revision)


def runtime_config(args: argparse.Namespace, model_dir: Path, default_max_total_tokens: int | None = None) -> RuntimeConfig:
    from splitspec.runtime.runner import RuntimeConfig

    max_total = args.max_total_tokens
    if max_total is None and args.mem_fraction_static is None:
        max_total = default_max_total_tokens
    return RuntimeConfig(
        model_path=str(model_dir),
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        max_total_tokens=max_total,
        mem_fraction_static=args.mem_fraction_static,
        attention_backend=args.attention_backend,
        cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", None),
        disable_cuda_graph=getattr(args, "disable_cuda_graph", False),
        seed=args.random_seed,
        attention_mode=getattr(args, "speculative_attention_mode", "prefill"),
        torch_compile_max_bs=torch_compile_max_bs(args),
        quantization=getattr(args, "quantization", None),
        piecewise_cuda_graph_max_tokens=piecewise_max_tokens(args),
        prompt_cuda_graph_max_tokens=0 if getattr(args, "disable_cuda_graph", False)
        else getattr(args, "prompt_cuda_graph_max_tokens", 0),
        cpu_wide_forward_threads=getattr(args, "cpu_wide_forward_threads", 0),
    )


def piecewise_max_tokens(args: argparse.Namespace) -> int:
    """0 with --disable-piecewise-cuda-graph or --disable-cuda-graph, else --piecewise-cuda-graph-max-tokens."""
    if getattr(args, "disable_piecewise_cuda_graph", False) or getattr(args, "disable_cuda_graph", False):
        return 0
    return getattr(args, "piecewise_cuda_graph_max_tokens", None) or DEFAULT_PIECEWISE_MAX_TOKENS


DEFAULT_TORCH_COMPILE_MAX_BS = 32


def torch_compile_max_bs(args: argparse.Namespace) -> int:
    """0 without --enable-torch-compile, else --torch-compile-max-bs (default 32, SGLang's)."""
    if not getattr(args, "enable_torch_compile", False):
        return 0
    return getattr(args, "torch_compile_max_bs", None) or DEFAULT_TORCH_COMPILE_MAX_BS
