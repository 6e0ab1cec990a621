"""ModelRunner: a loaded model, its paged KV cache and an attention backend, behind one forward().

    runner = ModelRunner.load(RuntimeConfig(model_path=...))
    table = BlockTable()
    out = runner.forward(build_forward_batch(runner.kv_cache, [SequenceInput(table, ids)], runner.device))
    runner.kv_cache.set_length(table, len(ids))          # commit
"""

from __future__ import annotations

import dataclasses

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from splitspec.runtime.attention import get_attention_backend
from splitspec.runtime.attention.base import AttentionBackend
from splitspec.runtime.batch import ForwardBatch, SequenceInput, build_forward_batch
from splitspec.runtime.batch_shift import settle_on_host
from splitspec.runtime.config import DTYPES, ConfigError, ModelConfig
from splitspec.runtime.host_threads import one_thread_for_gpu, wide_forwards
from splitspec.runtime.hub import resolve_model_dir
from splitspec.runtime.inference import inference
from splitspec.runtime.kv_cache import BlockTable, KVCache, OutOfPagesError
from splitspec.runtime import quantization
from splitspec.runtime.loader import load_model
from splitspec.runtime.quantization import weight_bytes as weight_bytes_of
from splitspec.runtime.models import model_class
from splitspec.runtime.piecewise_graph import SIZES

logger = logging.getLogger(__name__)

DEFAULT_GPU_MEM_FRACTION = 0.85
def default_cuda_graph_max_bs(device: torch.device) -> int:
    """The largest decode batch replayed from CUDA graphs when --cuda-graph-max-bs is not given, by the GPU's
    memory as SGLang sizes it: 256 on a GPU of more than 90 GiB (H200), 160 on one of more than 20 GiB (H100,
    A100), else 32. A server's batches above it run eagerly (an 8B target at batch 64: 0.36x the graphs' speed)."""
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    return 256 if total > 90 else 160 if total > 20 else 32
INITIAL_ROPE_POSITIONS = 32768  # the RoPE cache starts this large and grows when a batch needs more


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything needed to stand a model up; built once from the command line."""

    model_path: str
    revision: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    attention_backend: str = "auto"  # auto: flashinfer on CUDA when it imports, else torch
    cuda_graph_max_bs: int | None = None  # decode graphs up to this batch size (None: default_cuda_graph_max_bs)
    disable_cuda_graph: bool = False
    seed: int = 0
    capture_layers: tuple[int, ...] = ()  # layer inputs returned as aux hidden states
    family: str | None = None  # model family regardless of config.json (EAGLE heads look like Llama configs)
    attention_mode: str = "prefill"  # tree verification: one masked prefill pass, or decode rows (tree_decode)
    torch_compile_max_bs: int = 0  # > 0: uniform batches of up to this many requests run torch.compile'd (runtime.compile)
    quantization: str | None = None  # None, "fp8" or "unquant" (runtime.quantization; an FP8 checkpoint is detected)
    piecewise_cuda_graph_max_tokens: int = 0  # > 0 (with CUDA graphs): prompt chunks and mixed steps of up to this many tokens replay piecewise graphs
    prompt_cuda_graph_max_tokens: int = 0  # > 0 (with CUDA graphs): prompt steps of up to this many tokens replay whole graphs (runtime.prompt_graph)
    cpu_wide_forward_threads: int = 0  # > 0 on a CPU device: torch threads of a wide forward (host_threads.WideForwards)
    # a draft model in its target's process on the same GPU (the target took --mem-fraction-static first): its KV
    # cache holds as many tokens as the target's, or as many as fit in the memory the target left less a reserve
    kv_tokens_beside_target: int | None = None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V] fp32, rows = batch.logits_indices
    hidden_states: torch.Tensor | None = None  # [T, H] final normed state of every new token
    aux_hidden_states: torch.Tensor | None = None  # [T, len(capture_layers) * H] captured layer inputs


FLASHINFER_HEAD_DIMS = (64, 128, 256)


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """auto: FlashInfer on a CUDA device for fp16/bf16 models of its head sizes when the package imports,
    else the torch reference."""
    if name != "auto":
        return name
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim in FLASHINFER_HEAD_DIMS:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # noqa: BLE001 (missing, or built for another torch/CUDA)
            logger.warning("flashinfer does not import (%s); attention runs on the torch backend", exc)
            return "torch"
        return "flashinfer"
    return "torch"


def resolve_device(name: str) -> torch.device:
    """'auto' = the current CUDA device when there is one; 'cuda' gets its index made explicit."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto': on a GPU the checkpoint's dtype (fp32 checkpoints run in bf16); on a CPU fp32, since
    half-precision matrix products are several times slower there without bf16 matrix units (measured
    on the development machines' EPYC: 1.7x at one token, 7x at 64)."""
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"--dtype {name!r} is not supported (choose from auto, {', '.join(DTYPES)})")
        return getattr(torch, DTYPES[name])
    if device.type != "cuda":
        return torch.float32
    declared = getattr(torch, DTYPES.get(str(config.torch_dtype).replace("torch.", ""), "float32"))
    return torch.bfloat16 if declared == torch.float32 else declared


CPU_DEFAULT_MAX_TOKENS = 65536


def graph_scratch_pages(rc: RuntimeConfig, device: torch.device) -> int:
    """Pages the CUDA graphs' padding requests keep for good (StepGraphs._scratch): a chain as long as the longest
    prompt graph's chunks after one key; 0 without prompt graphs (a decode or tree graph's padding takes a page or a
    few, which a pool sized for requests has to spare) or without CUDA graphs."""
    if device.type != "cuda" or rc.disable_cuda_graph or rc.cuda_graph_max_bs == 0 or rc.prompt_cuda_graph_max_tokens <= 0:
        return 0
    return -(-(rc.prompt_cuda_graph_max_tokens + 1) // rc.page_size)


def kv_cache_num_pages(rc: RuntimeConfig, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Pages from --max-total-tokens, or on a GPU from --mem-fraction-static of its memory (a draft beside its
    target: kv_pages_beside_target). --max-total-tokens is the requests' pool: the graphs' padding requests get their
    scratch pages on top of it (graph_scratch_pages; a pool sized for one 384-token request could not capture the
    512-token prompt graphs, and `splitspec bench --batch-size 1` failed so on a GPU)."""
    if rc.max_total_tokens is not None:
        return -(-rc.max_total_tokens // rc.page_size) + graph_scratch_pages(rc, device)
    if rc.kv_tokens_beside_target is not None and device.type == "cuda":
        return kv_pages_beside_target(rc, config, dtype, device)
    if device.type != "cuda":  # CPU: four full contexts, at most 64Ki tokens and a tenth of the memory available now
        import os

        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_token = KVCache.bytes_per_token(config, dtype)
        num_tokens = min(4 * config.max_position_embeddings, CPU_DEFAULT_MAX_TOKENS, int(0.1 * available // per_token))
        if num_tokens < rc.page_size:
            raise ConfigError("not enough free memory for a KV cache on CPU; set --max-total-tokens")
        logger.info("KV cache on CPU: %d tokens (%.0f MiB); --max-total-tokens sets it", num_tokens,
                    num_tokens * per_token / 2**20)
        return num_tokens // rc.page_size
    torch.cuda.empty_cache()  # blocks freed while loading (each tensor read, quantized and copied) count as free
    free, total = torch.cuda.mem_get_info(device)
    fraction = rc.mem_fraction_static or DEFAULT_GPU_MEM_FRACTION
    budget = total * fraction - (total - free)
    num_tokens = int(budget // KVCache.bytes_per_token(config, dtype))
    if num_tokens < rc.page_size:
        raise ConfigError(f"--mem-fraction-static {fraction} leaves no memory for the KV cache after the weights")
    return num_tokens // rc.page_size


def kv_pages_beside_target(rc: RuntimeConfig, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """A draft model loaded into its target's process after the target sized its KV cache from
    --mem-fraction-static: see tokens_beside_target."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    tokens = tokens_beside_target(rc.kv_tokens_beside_target, free, total, rc.mem_fraction_static or DEFAULT_GPU_MEM_FRACTION,
                                  KVCache.bytes_per_token(config, dtype))
    return tokens // rc.page_size


def tokens_beside_target(wanted: int, free: int, total: int, fraction: float, per_token: int) -> int:
    """The draft's cache mirrors the target's token capacity (wanted; SGLang sizes its draft runner's cache
    likewise), or takes what fits in the free memory less half the headroom the fraction left the process
    (activations, CUDA graphs), with a warning. Too little fits: a ConfigError naming the flags that make room."""
    reserve = total * (1.0 - fraction) / 2
    fits = int(max(free - reserve, 0) // per_token)
    if fits < min(wanted, 1024):
        raise ConfigError(f"the draft model's KV cache does not fit beside the target's ({free / 2**30:.1f} GiB free, "
                          f"{reserve / 2**30:.1f} GiB kept for activations): lower --mem-fraction-static or set "
                          "--max-total-tokens")
    if fits < wanted:
        logger.warning("the draft model's KV cache holds %d tokens, fewer than the target's %d (the memory the target "
                       "left): a request it cannot hold decodes without drafts. Lower --mem-fraction-static for more",
                       fits, wanted)
    return min(wanted, fits)


def _graphs_supported(backend: AttentionBackend) -> bool:
    """The backend plans into fixed buffers (graph_state), unless it says otherwise (graphs_supported)."""
    return getattr(backend, "graphs_supported", hasattr(backend, "graph_state"))


class ModelRunner:
    def __init__(self, config: ModelConfig, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                 capture_layers: tuple[int, ...] = (), model_dir: Path | None = None, cuda_graph_max_bs: int = 0,
                 torch_compile_max_bs: int = 0, piecewise_max_tokens: int = 0, prompt_max_tokens: int = 0):
        """cuda_graph_max_bs > 0: decode steps of up to that many requests replay CUDA graphs (captured by
        capture_cuda_graphs(), or at the first decode step); needs a backend that plans into fixed buffers.
        torch_compile_max_bs > 0: uniform batches of up to that many requests (decode, tree verification,
        draft steps; and the graphs capturing them) run the torch.compile'd forward (runtime.compile).
        piecewise_max_tokens > 0 (with the step graphs): other forwards of up to that many tokens (prompt chunks,
        mixed steps) replay piecewise graphs, captured with the step graphs (runtime.piecewise_graph).
        prompt_max_tokens > 0 (with the step graphs): steps that only prefill, of up to that many tokens, replay whole
        graphs (runtime.prompt_graph; pad_prompts pads their chunks to a captured shape)."""
        self.config, self.model, self.kv_cache, self.backend = config, model, kv_cache, backend
        self.model_dir = model_dir
        self.device, self.dtype = kv_cache.device, kv_cache.dtype
        # the longest sequence its forwards serve: the model's own, or a served --context-length past it, or a draft's
        # target's (draft_models); what CUDA graphs are sized for (the RoPE cache they read, their page tables). Set
        # before the graphs are captured
        self.context_length = config.max_position_embeddings
        self.wide = None  # host_threads.WideForwards: a CPU model's threads for wide forwards (load() sets it)
        self.weight_bytes = weight_bytes_of(model)  # {"total", "fp8_layers"}: the model's own weights (shared ones not counted)
        self.cuda_graph_max_bs = cuda_graph_max_bs if _graphs_supported(backend) and self.device.type == "cuda" else 0
        self.graphs = None
        # piecewise graphs need every row computed on its own outside attention: per-tensor FP8 activation scales
        # would mix the padding rows into the real ones
        row_wise = not any(getattr(m, "gemm", None) == "tensorwise" for m in model.modules())
        self.piecewise_max_tokens = piecewise_max_tokens if self.cuda_graph_max_bs and row_wise else 0
        self.pad_eager = self.device.type == "cuda" and row_wise  # forward_padded pads (tests turn it on on a CPU)
        self.piecewise = None
        self.prompt_max_tokens = prompt_max_tokens if self.cuda_graph_max_bs and row_wise else 0
        self.prompts = None  # runtime.prompt_graph.PromptGraphs, captured with the step graphs
        # chunk lengths a prompt step is padded up to without CUDA graphs (the prompt graphs' own sizes pad with them):
        # tests exercise the padding on a CPU with it
        self.prompt_pad_sizes: tuple[int, ...] = ()
        self.padded_prompt_steps = 0  # prompt steps pad_prompts shaped (for a graph, or prompt_pad_sizes)
        # tree sizes a verification batch is padded up to without CUDA graphs (the graphs' own sizes pad with
        # them): tests exercise the padding on a CPU with it
        self.tree_pad_sizes: tuple[int, ...] = ()
        self.compiled = None
        if torch_compile_max_bs > 0:
            from splitspec.runtime.compile import CompiledForward

            self.compiled = CompiledForward(model, torch_compile_max_bs)
        self.set_capture_layers(capture_layers)
        self.model.rotary_emb.reserve(min(config.max_position_embeddings, INITIAL_ROPE_POSITIONS), self.device)

    def set_capture_layers(self, layers: tuple[int, ...]) -> None:
        """forward() returns the inputs of these decoder layers (i == num_layers: the last one's output
        before the final norm) as aux_hidden_states, concatenated in this order (EAGLE-3's features)."""
        bad = [i for i in layers if not 0 <= i <= self.config.num_hidden_layers]
        if bad:
            raise ConfigError(f"capture layers {bad} out of range for {self.config.num_hidden_layers} layers")
        if len(set(layers)) != len(layers):
            raise ConfigError(f"capture layers {list(layers)} repeat a layer")
        if getattr(self, "capture_layers", None) != tuple(layers) and getattr(self, "graphs", None) is not None:
            self.kv_cache.allocator.decref(self.graphs.scratch_pages)  # the graphs captured other outputs
            self.graphs = None
            self.piecewise = None
            self.prompts = None
        self.capture_layers = tuple(layers)

    def capture_cuda_graphs(self, tree_nodes: tuple[int, ...] = ()) -> None:
        """Capture the decode graphs, and the verification graphs of trees of these node counts, now
        (servers do this before serving; otherwise the decode graphs are captured at the first decode step)."""
        if not self.cuda_graph_max_bs:
            return
        if self.graphs is None:
            from splitspec.runtime.cuda_graph import StepGraphs

            self.graphs = StepGraphs(self, self.cuda_graph_max_bs)
        for q in (1, *tree_nodes):
            if q >= 1:
                self.graphs.capture(q)
        if self.piecewise is None and self.piecewise_max_tokens:
            from splitspec.runtime.piecewise_graph import PiecewiseGraphs

            self.piecewise = PiecewiseGraphs(self, self.piecewise_max_tokens)
            self.piecewise.capture()
        if self.prompts is None and self.prompt_max_tokens:
            from splitspec.runtime.prompt_graph import PromptGraphs

            prompts = PromptGraphs(self.graphs, self.prompt_max_tokens)
            try:
                prompts.capture()
            except RuntimeError as e:  # out of memory among them; on by default: say which flag turns it off
                raise RuntimeError(f"capturing CUDA graphs of prompt steps failed ({e}); --prompt-cuda-graph-max-tokens 0 "
                                   "runs them from piecewise graphs instead") from e
            self.prompts = prompts

    @property
    def request_pages(self) -> int:
        """KV pages requests can have: the cache's less those the CUDA graphs' padding requests hold for good."""
        return self.kv_cache.num_pages - (len(self.graphs.scratch_pages) if self.graphs is not None else 0)

    def prompt_graph_size(self, num_requests: int, longest: int) -> int | None:
        """The length a prompt step of num_requests chunks, the longest of `longest` tokens, is padded to for a
        captured prompt graph (prompt_pad_sizes on a CPU), or None where none holds it."""
        size = self.prompts.size_for(num_requests, longest) if self.prompts is not None else None
        return size if size is not None else min((q for q in self.prompt_pad_sizes if q >= longest), default=None)

    def pad_prompts(self, sequences: list[SequenceInput]) -> list[SequenceInput]:
        """A step's prompt chunks padded with filler tokens to one captured prompt graph's shape (runtime.prompt_graph;
        prompt_pad_sizes on a CPU), or as they are: chunks asking for every row's logits (prompt logprobs), none that
        fits, or too few free KV pages for the filler slots."""
        if not sequences or any(s.mask is not None or s.positions is not None or s.logits == "all" for s in sequences):
            return sequences
        size = self.prompt_graph_size(len(sequences), max(len(s.input_ids) for s in sequences))
        if size is None or any(s.table.num_tokens + size > self.config.max_position_embeddings for s in sequences):
            return sequences
        kv = self.kv_cache
        pages = sum(max(kv.pages_for(s.table.num_tokens + size) - len(s.table.pages), 0) for s in sequences)
        if pages > kv.allocator.num_free:
            return sequences
        self.padded_prompt_steps += 1
        return [s if len(s.input_ids) == size else dataclasses.replace(
            s, input_ids=s.input_ids + [s.input_ids[-1]] * (size - len(s.input_ids)), padding=size - len(s.input_ids))
            for s in sequences]

    def padded_tree_size(self, num_requests: int, largest: int) -> int | None:
        """The node count a verification batch of num_requests trees, the largest of `largest` nodes, is
        padded to so that it replays a captured graph (the smallest captured tree size that holds it), or
        None where none does (no graphs, too many requests, a tree larger than every captured size)."""
        sizes = self.tree_pad_sizes
        if self.graphs is not None and num_requests <= self.graphs.max_bs:
            sizes = (*sizes, *self.graphs.tree_sizes)
        return min((q for q in sizes if q >= largest), default=None)

    def capture_feature_graphs(self, token_counts, widths, max_rows: int | None = None) -> None:
        """A draft head's forwards fed features (catch-ups, overlap's bets): CUDA graphs for batches whose
        requests each add the same number of tokens, one of token_counts, fed features of one of widths
        (e.g. the target's and the head's own), for batches of at most max_rows rows (None: every captured batch
        size); other such forwards run eagerly."""
        if not self.cuda_graph_max_bs:
            return
        from splitspec.runtime.cuda_graph import StepGraphs

        if self.graphs is None:
            self.graphs = StepGraphs(self, self.cuda_graph_max_bs)
        for width in widths:
            for q in token_counts:
                self.graphs.capture(q, width, max_rows)

    @classmethod
    def load(cls, rc: RuntimeConfig) -> "ModelRunner":
        model_dir = resolve_model_dir(rc.model_path, rc.revision)
        config = ModelConfig.from_dir(model_dir)
        if rc.family is not None:
            config = dataclasses.replace(config, family=rc.family)
            adapt = getattr(model_class(config), "runtime_config", None)
            if adapt is not None:  # a head living inside another model's checkpoint (MTP layers)
                config = adapt(config)
        device = resolve_device(rc.device)
        if device.type == "cuda" and device.index is not None:
            # Triton and FlashInfer launch on the current device: make it this model's (a drafter on cuda:1)
            torch.cuda.set_device(device)
        dtype = resolve_dtype(rc.dtype, config, device)
        logger.info("loading %s (%s, %d layers) from %s as %s on %s", config.architecture, config.model_type,
                    config.num_hidden_layers, model_dir, str(dtype).replace("torch.", ""), device)
        model = load_model(model_dir, config, dtype, device, rc.load_format, rc.seed, rc.quantization)
        logger.info("weights: %.1f MB%s", weight_bytes_of(model)["total"] / 1e6,
                    f"; {quantization.describe(model, model.quant_plan, dtype)}" if model.quant_plan.quantized else "")
        num_pages = kv_cache_num_pages(rc, config, dtype, device)
        kv_cache = KVCache(config, num_pages, rc.page_size, dtype, device)
        scratch = graph_scratch_pages(rc, device) if rc.max_total_tokens is not None else 0
        logger.info("KV cache: %d pages x %d tokens (%.1f MB)%s", num_pages, rc.page_size,
                    num_pages * rc.page_size * KVCache.bytes_per_token(config, dtype) / 1e6,
                    f", {scratch} of them the CUDA graphs' padding requests'" if scratch else "")
        backend_name = resolve_attention_backend(rc.attention_backend, device, dtype, config.head_dim)
        backend = get_attention_backend(backend_name)(config, kv_cache)
        if rc.attention_mode == "decode":
            from splitspec.runtime.attention.tree_decode import DecodeModeBackend

            backend = DecodeModeBackend(backend)
        max_bs = 0 if rc.disable_cuda_graph else (rc.cuda_graph_max_bs or default_cuda_graph_max_bs(device))
        logger.info("attention backend %s%s%s", backend_name, ", trees verified in decode mode" if rc.attention_mode == "decode" else "",
                    f", CUDA graphs for decode batches up to {max_bs}" if max_bs and device.type == "cuda"
                    and _graphs_supported(backend) else "")
        if rc.torch_compile_max_bs:
            logger.info("torch.compile for uniform batches of up to %d requests (each new token count compiles "
                        "once, at its first use)", rc.torch_compile_max_bs)
        one_thread_for_gpu(device)  # after the load, whose host work may use the pool
        runner = cls(config, model, kv_cache, backend, rc.capture_layers, model_dir, cuda_graph_max_bs=max_bs,
                     torch_compile_max_bs=rc.torch_compile_max_bs, piecewise_max_tokens=rc.piecewise_cuda_graph_max_tokens,
                     prompt_max_tokens=rc.prompt_cuda_graph_max_tokens)
        runner.wide = wide_forwards(device, rc.cpu_wide_forward_threads)
        return runner

    def model_call(self, num_requests: int | None, input_ids: torch.Tensor, positions: torch.Tensor, backend, plan,
                   capture_layers: tuple[int, ...] = (), **extra):
        """The model's forward for a step-shaped batch of num_requests (None: another shape): compiled when
        --enable-torch-compile covers that batch size, else eager."""
        if self.compiled is not None and num_requests is not None and num_requests <= self.compiled.max_bs:
            return self.compiled(input_ids, positions, backend, plan, capture_layers, **extra)
        return self.model(input_ids, positions, backend, plan, capture_layers, **extra)

    def batch(self, sequences: list[SequenceInput]) -> ForwardBatch:
        return build_forward_batch(self.kv_cache, sequences, self.device)

    def forward_padded(self, sequences: list[SequenceInput], features: torch.Tensor | None = None, graphs: bool = True,
                       **kwargs) -> ForwardOutput:
        """forward(batch(sequences), features=features, **kwargs), padded (with pad_eager: on a GPU) up to the next size
        of runtime.piecewise_graph.SIZES by one more sequence, of token 0 on a scratch table of its own with no logits
        (zero features), where no captured graph replays the batch as it is: its GEMMs then run at row counts cuBLAS
        has chosen kernels for already (on an H200 a row count never seen cost 0.1-2.5 ms of host time per GEMM; a
        drafter's catch-ups come in any count: prompts, accept lengths, a drafting-off run's backlog). Not padded past
        the ladder or short of pages. The output's states are the real rows' only; the scratch table's pages go back
        once the forward is queued (what reuses them is queued after it). graphs False: the forward never replays one
        (an MTP layer's)."""
        rows = sum(len(s.input_ids) for s in sequences)
        size = next((s for s in SIZES if s >= rows), 0) if self.pad_eager else 0
        lengths = {len(s.input_ids) for s in sequences}
        q = lengths.pop() if len(lengths) == 1 else 0
        width = 0 if features is None else features.shape[-1]
        # a captured graph replays it as it is: a head's chains of q tokens, or one token each (decode-shaped)
        if size <= rows or (graphs and self.graphs is not None and (q == 1 or (q and width))
                            and self.graphs.has(q, width, len(sequences))):
            return self.forward(self.batch(sequences), features=features, **kwargs)
        scratch = BlockTable()
        try:
            batch = self.batch([*sequences, SequenceInput(scratch, [0] * (size - rows), logits="none")])
        except OutOfPagesError:  # the real sequences' pages are reserved by now: they keep them
            self.kv_cache.release(scratch)
            return self.forward(self.batch(sequences), features=features, **kwargs)
        if features is not None:
            features = torch.cat([features, features.new_zeros(size - rows, width)])
        output = self.forward(batch, features=features, **kwargs)
        self.kv_cache.release(scratch)
        return ForwardOutput(output.logits, None if output.hidden_states is None else output.hidden_states[:rows],
                             None if output.aux_hidden_states is None else output.aux_hidden_states[:rows])

    @inference
    def forward(self, batch: ForwardBatch, return_hidden: bool = False, features: torch.Tensor | None = None,
                draft_layer: int | None = None, borrow: bool = False) -> ForwardOutput:
        """features [T, F]: one per new token, for models that take them (draft heads); draft_layer: which
        of a multi-layer MTP head's layers runs. A wide forward on a CPU may take more threads (self.wide).
        borrow: a graph's outputs may be its own buffers, not copies (the caller reads them only by work it queues
        before the next replay)."""
        if self.wide is None:
            return self._forward(batch, return_hidden, features, draft_layer, borrow)
        with self.wide.around(batch.num_tokens):
            return self._forward(batch, return_hidden, features, draft_layer, borrow)

    def _forward(self, batch: ForwardBatch, return_hidden: bool, features: torch.Tensor | None,
                 draft_layer: int | None, borrow: bool = False) -> ForwardOutput:
        self.model.rotary_emb.reserve(batch.max_position + 1, self.device)  # found as the batch was built: no tensor op
        if self.cuda_graph_max_bs and draft_layer is None:
            if self.graphs is None and features is None:
                self.capture_cuda_graphs()
            chains = features is not None  # a head's catch-up or bets: graphs captured by capture_feature_graphs
            q = self.graphs.tokens_per_request(batch, chains) if self.graphs is not None else None
            width = 0 if features is None else features.shape[-1]
            if q is not None and self.graphs.has(q, width, batch.attention.num_requests):
                hidden, captured, logits = self.graphs.run(batch, q, None if features is None else features.to(self.device),
                                                           return_hidden, borrow)
                return ForwardOutput(logits=logits, hidden_states=hidden, aux_hidden_states=captured)
            q = self.prompts.shape_of(batch) if self.prompts is not None and features is None else None
            if q is not None:
                hidden, captured, logits = self.prompts.run(batch, q, return_hidden)
                return ForwardOutput(logits=logits, hidden_states=hidden, aux_hidden_states=captured)
        if batch.shift is not None:  # no graph moved it on the device (a tree is no prompt graph's): on the host
            settle_on_host(batch, self.kv_cache.page_size)
        plan = self.backend.plan(batch.attention)
        extra = {} if features is None else {"features": features.to(self.device)}
        if draft_layer is not None:
            extra["draft_layer"] = draft_layer
        # a step-shaped batch may run compiled; prompt chunks and mixed batches (token counts without bound) never
        step_shaped = batch.attention.step_tokens is not None
        if self.piecewise is not None and features is None and draft_layer is None \
                and self.piecewise.covers(batch.num_tokens):
            hidden, captured = self.piecewise.run(batch, plan)  # views of static buffers: the next replay overwrites
            hidden = hidden.clone() if return_hidden else hidden  # (the logits' rows and the cat below are copies)
        else:
            hidden, captured = self.model_call(batch.attention.num_requests if step_shaped else None, batch.input_ids,
                                               batch.positions, self.backend, plan, self.capture_layers, **extra)
        logits = self.model.logits(hidden[batch.logits_indices])
        return ForwardOutput(
            logits=logits,
            hidden_states=hidden if return_hidden else None,
            aux_hidden_states=torch.cat(captured, dim=-1) if captured else None,
        )
