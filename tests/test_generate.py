"""`splitspec generate`: greedy ids equal transformers' generate; EOS, seeds and batching behave."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_match, load_runner, make_hf_model

from splitspec import lifeline
from splitspec.generate import generate_ids
from splitspec.runtime.sampling_params import SamplingParams

WORDS = "the a of to and in is it that for on with as was def return class import self if else for while".split()


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=0,
                             min_new_tokens=0 if eos_token_id is not None else max_new_tokens)
    return out[0, len(ids) :].tolist()


def make_tokenizer(path: Path) -> int:
    """A word-level tokenizer saved in HF format; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>", *dict.fromkeys(WORDS)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    return len(vocab)


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("with-tokenizer")
    vocab_size = make_tokenizer(path)
    model = make_hf_model("llama-gqa-llama3", seed=9, vocab_size=vocab_size)
    model.save_pretrained(path)
    return path, model


def test_greedy_batch_equals_transformers_generate(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["qwen3-qk-norm"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = load_runner(path, page_size=4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 12, 7, 1)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (24, 9, 17, 30)]
    gens = generate_ids(runner, prompts, params, eos_ids={2})
    for i, (gen, prompt, p) in enumerate(zip(gens, prompts, params)):
        assert_greedy_match(gen.output_ids, hf_greedy(reference, prompt, p.max_new_tokens), reference, prompt, f"batch prompt {i}")
        assert gen.finish_reason == "length" and len(gen.output_ids) == p.max_new_tokens
    assert runner.kv_cache.allocator.num_used == 0


def test_eos_stops_generation(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama-tied"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = load_runner(path)
    prompt = [5, 6, 7]
    free_run = hf_greedy(reference, prompt, 12)
    eos = free_run[4]
    stop_at = free_run.index(eos)
    gen = generate_ids(runner, [prompt], [SamplingParams(temperature=0.0, max_new_tokens=12)], eos_ids={eos})[0]
    assert gen.output_ids == free_run[: stop_at + 1] == hf_greedy(reference, prompt, 12, eos_token_id=eos)
    assert gen.finish_reason == "stop"
    ignoring = generate_ids(runner, [prompt], [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)], {eos})[0]
    assert ignoring.output_ids == free_run and ignoring.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_checkpoints):
    runner = load_runner(tiny_checkpoints["llama-gqa-llama3"])
    prompts = [[5, 9, 12], [40, 41], [7] * 6]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_new_tokens=20, ignore_eos=True) for s in (1, 2, 3)]
    together = [g.output_ids for g in generate_ids(runner, prompts, params, set())]
    alone = [generate_ids(runner, [p], [sp], set())[0].output_ids for p, sp in zip(prompts, params)]
    assert together == alone
    other_seed = generate_ids(runner, prompts[:1], [SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                                    max_new_tokens=20, ignore_eos=True)], set())
    assert other_seed[0].output_ids != together[0]
    greedy = generate_ids(runner, prompts[:1], [SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)], set())
    assert greedy[0].output_ids != together[0]  # sampling really sampled


def run_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return lifeline.run([sys.executable, "-P", "-m", "splitspec", "generate", *args, "--log-level", "warning"],
                          capture_output=True, text=True, timeout=300, env=env)


def test_cli_prompt_text_json(model_with_tokenizer):
    from transformers import AutoTokenizer

    path, model = model_with_tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = "def the class import self"
    result = run_cli("--model-path", str(path), "--prompt", prompt, "--max-new-tokens", "10", "--ignore-eos",
                     "--dtype", "float32", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    ids = tokenizer.encode(prompt)
    assert out["prompt_ids"] == ids
    assert_greedy_match(out["output_ids"], hf_greedy(model, ids, 10), model, ids, "cli --prompt")
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["finish_reason"] == "length"


def test_cli_input_ids_batch_and_sampling_flags(model_with_tokenizer):
    path, model = model_with_tokenizer
    args = ["--model-path", str(path), "--input-ids", "4,5,6", "--input-ids", "7, 8", "--max-new-tokens", "6",
            "--ignore-eos", "--dtype", "float32", "--json"]
    greedy = run_cli(*args)
    assert greedy.returncode == 0, greedy.stderr
    rows = [json.loads(line) for line in greedy.stdout.splitlines()]
    for row, prompt in zip(rows, ([4, 5, 6], [7, 8])):
        assert_greedy_match(row["output_ids"], hf_greedy(model, prompt, 6), model, prompt, f"cli --input-ids {prompt}")
    assert len(rows) == 2
    sampled = [run_cli(*args, "--temperature", "1.0", "--top-k", "5", "--seed", "11") for _ in range(2)]
    assert sampled[0].returncode == 0, sampled[0].stderr
    assert sampled[0].stdout == sampled[1].stdout
    assert [json.loads(line)["seed"] for line in sampled[0].stdout.splitlines()] == [11, 11]


def test_cli_rejects_bad_input(model_with_tokenizer):
    path, model = model_with_tokenizer
    context = model.config.max_position_embeddings
    runs = [("--model-path", str(path), "--input-ids", "1,99999"), ("--model-path", str(path), "--input-ids", "1,x"),
            ("--model-path", str(path)), ("--model-path", "/no/such/dir", "--input-ids", "1"),
            ("--model-path", str(path), "--input-ids", "1,2,3", "--max-new-tokens", "40", "--max-total-tokens", "16",
             "--page-size", "4"),
            ("--model-path", str(path), "--input-ids", "1,2,3", "--max-new-tokens", str(context - 2))]
    with ThreadPoolExecutor(3) as pool:  # separate processes: side by side
        out_of_vocab, garbage, nothing, missing, small_cache, too_long = pool.map(lambda args: run_cli(*args), runs)
    # past the model's context, as the gateway refuses it (a GPU's graphs have no pages for it: it crashed there)
    assert too_long.returncode == 2, too_long.stderr
    assert f"maximum context length is {context} tokens; the longest prompt has 3 tokens" in too_long.stderr
    assert out_of_vocab.returncode == 2 and "outside the vocabulary" in out_of_vocab.stderr
    assert garbage.returncode == 2 and "comma-separated integers" in garbage.stderr
    assert nothing.returncode == 2 and "--prompt or --input-ids" in nothing.stderr
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    assert small_cache.returncode == 2 and "--max-total-tokens 16 is too small" in small_cache.stderr
    assert "Traceback" not in small_cache.stderr


def test_help_explains_every_flag():
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "generate", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    from splitspec.generate import build_parser

    for action in build_parser()._actions:
        assert action.help, f"flag {action.option_strings} has no help text"
        for flag in action.option_strings:
            assert flag in result.stdout
