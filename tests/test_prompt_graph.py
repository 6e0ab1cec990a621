"""runtime.prompt_graph's own bookkeeping on a CPU, where no CUDA graph exists: a stand-in graph that replays by running
the captured forward again into the captured outputs, and the torch attention backend planned at each replay into the
graph's state, as FlashInfer's wrappers are planned into their fixed buffers. What this checks is the prompt graphs'
part: the static inputs copied and padded (filler rows, dummy requests), the logits taken at each chunk's last real
row through the static row index, the outputs of a smaller batch read from the largest's, the captured layers'
rows. The graphs' FlashInfer attention is tests/test_gpu_kernels.py::test_prompt_graphs_equal_eager's (a GPU)."""

from __future__ import annotations

import types

import pytest
import torch
from test_speculative import PROMPTS, ngram

from splitspec.demo import demo_model_dirs
from splitspec.runtime import prompt_graph
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.cuda_graph import StepGraphs
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import Engine, SchedulerConfig, SpecConfig


class StandInGraph:
    """Replays by running the forward again and writing its results into the outputs it gave at capture."""

    def __init__(self, forward, outputs):
        self.forward, self.outputs = forward, outputs

    def replay(self):
        for out, value in zip(self.outputs, self.forward()):
            if out is not None and out.data_ptr() != value.data_ptr():  # a smaller batch wrote the largest's already
                out.copy_(value)


def stand_in_capture(forward, pool, stream, device):
    outputs = forward()
    return StandInGraph(forward, outputs), outputs


class PlannedAtReplay:
    """The torch backend with graph_state / graph_plan: the batch planned into the state at every replay."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def graph_state(self, batch_size, max_pages, q_len=1, max_kv_len=0, causal=False):
        assert causal and q_len > 1
        return types.SimpleNamespace(batch_size=batch_size, q_len=q_len, plan=None)

    def graph_plan(self, state, batch):
        assert batch.num_requests == state.batch_size and set(batch.q_lens) == {state.q_len}
        state.plan = self.inner.plan(batch)
        return state.plan


@pytest.fixture
def graphed(monkeypatch):
    """A demo-target runner whose prompt graphs (128 tokens at most) are stand-ins, and a plain one beside it."""
    target = demo_model_dirs()["target"]
    config = RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=4096, page_size=16)
    monkeypatch.setattr(prompt_graph, "warm_and_capture", stand_in_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)

    def with_graphs(capture_layers=()):
        runner = ModelRunner.load(config)
        runner.set_capture_layers(capture_layers)
        runner.backend = PlannedAtReplay(runner.backend)
        runner.cuda_graph_max_bs = 8
        runner.graphs = StepGraphs(runner, 8)
        runner.prompts = prompt_graph.PromptGraphs(runner.graphs, 128)
        runner.prompts.capture()
        return runner

    return with_graphs, ModelRunner.load(config)


def test_prompt_graphs_give_the_eager_forwards_logits_and_states(graphed):
    with_graphs, eager = graphed
    for layers in ((), (0, 2, 3)):
        runner = with_graphs(layers)
        eager.set_capture_layers(layers)
        assert runner.prompts.sizes == [16, 32, 64, 128] and runner.prompts.batch_sizes[32] == [1, 2, 4]
        g = torch.Generator().manual_seed(2)
        tables = {id(r): [BlockTable() for _ in range(4)] for r in (eager, runner)}
        replays = 0
        for chunks, logits in (([(0, 13)], "last"), ([(1, 30), (2, 5), (3, 17)], "last"), ([(0, 9), (1, 16)], "none"),
                               ([(2, 12), (3, 3)], "last"), ([(0, 40)], "last"), ([(1, 130)], "last"), ([(2, 70)], "last")):
            ids = {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in chunks}
            outs = []
            for r in (eager, runner):
                seqs = [SequenceInput(tables[id(r)][i], ids[i], logits=logits) for i, _ in chunks]
                padded = r.pad_prompts(seqs) if r is runner else seqs
                outs.append((r.forward(r.batch(padded), return_hidden=True), [len(s.input_ids) for s in padded]))
                for i, n in chunks:
                    r.kv_cache.set_length(tables[id(r)][i], tables[id(r)][i].num_tokens + n)
            (want, _), (have, sizes) = outs
            assert have.logits.shape == want.logits.shape
            assert torch.allclose(have.logits, want.logits, atol=1e-4, rtol=1e-4)
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            for k, (_, n) in enumerate(chunks):  # each chunk's real rows, after the fillers of the ones before it
                real = slice(starts[k], starts[k] + n)
                other = slice(sum(m for _, m in chunks[:k]), sum(m for _, m in chunks[: k + 1]))
                assert torch.allclose(have.hidden_states[real], want.hidden_states[other], atol=1e-4, rtol=1e-4)
                if layers:
                    assert torch.allclose(have.aux_hidden_states[real], want.aux_hidden_states[other], atol=1e-4, rtol=1e-4)
            replays += max(n for _, n in chunks) <= 128
            assert runner.prompts.replays == replays  # the 130-token chunk: no prompt graph holds it
        for r in (eager, runner):
            for table in tables[id(r)]:
                r.kv_cache.release(table)


def test_arrivals_through_prompt_graphs_keep_outputs(graphed):
    """The engine's prompt steps (arrivals into a speculating NGRAM batch, chunks of 24) through the stand-in graphs:
    outputs equal those of the same engine without them."""
    with_graphs, eager = graphed
    runner = with_graphs()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dirs()["target"])
    prompts = [tokenizer.encode(p) for p in PROMPTS[:9]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * len(prompts)
    outputs = []
    for r in (eager, runner):
        engine = Engine(r, ngram(), SpecConfig(num_draft_tokens=8), set(),
                        SchedulerConfig(max_running_requests=3, chunked_prefill_size=24))
        outputs.append([q.output_ids for q in engine.run(prompts, params)])
        scratch = r.graphs.scratch_pages if r.graphs is not None else []  # the dummy requests' own, kept for good
        assert r.kv_cache.allocator.num_used == len(scratch)
    assert outputs[1] == outputs[0]
    assert runner.prompts.replays >= len(prompts) - 3 and runner.padded_prompt_steps == runner.prompts.replays


def test_a_failed_capture_names_the_flag_and_keeps_no_partial_graphs(graphed, monkeypatch):
    """On by default, so a capture that fails (out of memory, say) must say which flag turns the prompt graphs off, and
    leave the runner without half of them (a later prompt step would look up a shape never captured)."""
    with_graphs, _ = graphed
    runner = with_graphs()
    runner.prompts, runner.prompt_max_tokens = None, 128
    monkeypatch.setattr(runner.graphs, "capture", lambda q: None)  # the step graphs: not this test's
    captured = []

    def fails_at_the_third(forward, pool, stream, device):
        if len(captured) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        captured.append(forward)
        return stand_in_capture(forward, pool, stream, device)

    monkeypatch.setattr(prompt_graph, "warm_and_capture", fails_at_the_third)
    with pytest.raises(RuntimeError, match="--prompt-cuda-graph-max-tokens 0"):
        runner.capture_cuda_graphs(())
    assert runner.prompts is None and len(captured) == 2


def test_the_graphs_padding_pages_come_on_top_of_max_total_tokens():
    """--max-total-tokens sizes the requests' pool; on a GPU with prompt graphs the padding requests' scratch pages (a
    chain of the longest prompt graph's tokens after one key) are added to it, not taken from it: `splitspec bench
    --batch-size 1` sized a 27-page pool for one request and could not capture the 512-token prompt graphs. With no
    prompt graphs, no CUDA graphs, or on a CPU, the pool is what was asked for."""
    from splitspec.runtime.runner import graph_scratch_pages, kv_cache_num_pages

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    config = RuntimeConfig(model_path="unused", max_total_tokens=417, page_size=16, prompt_cuda_graph_max_tokens=512)
    assert graph_scratch_pages(config, cuda) == 33  # 513 tokens of 16
    assert kv_cache_num_pages(config, None, None, cuda) == 27 + 33
    for other, device in ((config, cpu), (RuntimeConfig(model_path="unused", max_total_tokens=417, page_size=16), cuda),
                          (RuntimeConfig(model_path="unused", max_total_tokens=417, page_size=16, disable_cuda_graph=True,
                                         prompt_cuda_graph_max_tokens=512), cuda),
                          (RuntimeConfig(model_path="unused", max_total_tokens=417, page_size=16, cuda_graph_max_bs=0,
                                         prompt_cuda_graph_max_tokens=512), cuda)):
        assert graph_scratch_pages(other, device) == 0 and kv_cache_num_pages(other, None, None, device) == 27


def test_requests_are_offered_the_pages_the_graphs_padding_does_not_hold(graphed):
    """The pages the graphs' padding requests keep for good (a 128-token prompt graph's chain after one key: 9 pages of
    16) are not the requests': what the gRPC front checks a request against (Limits.kv_pages) and what the engine's
    refusal names is the cache less them."""
    with_graphs, eager = graphed
    runner = with_graphs()
    assert len(runner.graphs.scratch_pages) == 9
    assert runner.request_pages == runner.kv_cache.num_pages - 9 == 256 - 9
    assert eager.request_pages == eager.kv_cache.num_pages == 256
