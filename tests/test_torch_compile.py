"""--enable-torch-compile (runtime.compile): the verifier's flags turn it on; greedy speculative decoding with
the compiled forward gives the eager outputs token for token, with drafts proposed and accepted and no
fallbacks; decode and verification batches really ran the compiled code (inductor on CPU), each token count
compiled once, and the whole forward traced as one graph (attention is one opaque op, no graph breaks)."""

from __future__ import annotations

from test_speculative import PROMPTS, REPETITIVE, ngram, run
from transformers import AutoTokenizer

from splitspec.demo import demo_model_dirs
from splitspec import model_flags
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import SpecConfig
from splitspec.verifier_svc.server import build_parser


def test_flags_set_the_compiled_batch_sizes():
    target = demo_model_dirs()["target"]
    parse = build_parser().parse_args
    assert model_flags.runtime_config(parse(["--model-path", str(target)]), target).torch_compile_max_bs == 0
    on = parse(["--model-path", str(target), "--enable-torch-compile"])
    assert model_flags.runtime_config(on, target).torch_compile_max_bs == model_flags.DEFAULT_TORCH_COMPILE_MAX_BS
    on = parse(["--model-path", str(target), "--enable-torch-compile", "--torch-compile-max-bs", "4"])
    assert model_flags.runtime_config(on, target).torch_compile_max_bs == 4


def test_compiled_forward_decodes_as_the_eager_one(monkeypatch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setenv("SPLITSPEC_TORCH_COMPILE_MODE", "default")  # max-autotune would benchmark kernels on CPU
    target = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(PROMPTS[i]) for i in REPETITIVE[:3]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * len(prompts)
    parse = build_parser().parse_args
    outputs, runners = {}, {}
    torch._dynamo.reset()
    counters.clear()
    for flags in ([], ["--enable-torch-compile", "--torch-compile-max-bs", "2"]):
        args = parse(["--model-path", str(target), "--device", "cpu", "--dtype", "float32", "--max-total-tokens",
                      "4096", *flags])
        runner = ModelRunner.load(model_flags.runtime_config(args, target))
        outputs[bool(flags)] = run(runner, prompts, params, ngram(), SpecConfig(num_draft_tokens=8), batch=2)
        runners[bool(flags)] = runner
    compiled = runners[True].compiled
    assert runners[False].compiled is None and compiled is not None and compiled.max_bs == 2
    for a, b in zip(outputs[False], outputs[True]):
        assert a.output_ids == b.output_ids
        assert b.stats.accepted_tokens > 0 and b.stats.fallbacks == 0
    token_counts = {key[0] for key in compiled.compile_seconds}
    assert 1 in token_counts and any(n > 1 for n in token_counts)  # decode steps and tree verification
    assert compiled.calls > len(compiled.compile_seconds)  # compiled shapes were reused, not recompiled per call
    assert all(s > 0 for s in compiled.compile_seconds.values())
    assert not counters["graph_break"], dict(counters["graph_break"])
