"""Every `python3 -m sglang.launch_server ...` line of SGLang's speculative-decoding page (the seed,
../shared/seed/speculative_decoding.md) runs as `splitspec up ...` with local model directories in place
of the hub ids, and answers the page's request through the `openai` client."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from test_launcher import Up

from splitspec.demo import demo_model_dirs

SEEDS = [Path(os.environ.get("SPLITSPEC_SEED", "")), Path(__file__).resolve().parents[2] / "shared" / "seed",
         Path("/work/shared/seed")]
REQUEST = [{"role": "user", "content": "List 3 countries and their capitals."}]  # the page's request


def launch_lines(text: str) -> list[tuple[dict, list[str]]]:
    """(environment, flags) of every launch_server command in the page's bash blocks."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        command = block.replace("\\\n", " ")
        for line in command.splitlines():
            if "sglang.launch_server" not in line:
                continue
            words = shlex.split(line)
            at = words.index("sglang.launch_server")
            env = dict(w.split("=", 1) for w in words[: at - 2] if "=" in w)  # VAR=value python3 -m ...
            lines.append((env, words[at + 1 :]))
    return lines


@pytest.fixture(scope="module")
def local_models(tmp_path_factory):
    from draft_training import write_mimo_target
    from test_mtp import random_mtp_layers

    dirs = demo_model_dirs(heads=True)
    tmp = tmp_path_factory.mktemp("seed")
    token_map = tmp / "freq_32768.pt"
    torch.save(torch.arange(1024), token_map)  # FR-Spec's format: the most frequent token ids
    target, eagle = str(dirs["target"]), str(dirs["eagle"])
    return {
        "meta-llama/Llama-2-7b-chat-hf": target, "meta-llama/Meta-Llama-3-8B-Instruct": target,
        "meta-llama/Meta-Llama-3.1-8B-Instruct": target, "Qwen/Qwen2.5-7B-Instruct": target, "<your-model>": target,
        "lmsys/sglang-EAGLE-llama2-chat-7B": eagle, "lmsys/sglang-EAGLE-LLaMA3-Instruct-8B": eagle,
        "<your-draft-model>": eagle, "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B": str(dirs["eagle3"]),
        "Qwen/Qwen2.5-1.5B-Instruct": str(dirs["draft"]),
        "thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt": str(token_map),
        "XiaomiMiMo/MiMo-7B-RL": str(write_mimo_target(tmp / "mimo", random_mtp_layers(1, seed=3))),
    }


def test_every_seed_launch_line_runs_as_splitspec_up(local_models):
    from openai import OpenAI

    path = next((p / "speculative_decoding.md" for p in SEEDS if (p / "speculative_decoding.md").is_file()), None)
    if path is None:
        pytest.skip("../shared/seed/speculative_decoding.md is not on this machine (CI always has it)")
    lines = launch_lines(path.read_text())
    assert len(lines) >= 9, lines
    for env, flags in lines:
        flags = list(flags)
        for i, word in enumerate(flags[:-1]):
            if word in ("--model", "--model-path", "--speculative-draft-model-path", "--speculative-token-map"):
                assert flags[i + 1] in local_models, f"the seed names a model this test has no local copy of: {flags[i + 1]}"
                flags[i + 1] = local_models[flags[i + 1]]
        model = flags[flags.index("--model") + 1]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            up = Up("--drafters", "1", *flags)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            up.wait_for_line(r"serving .* at http")
            client = OpenAI(base_url=up.url + "/v1", api_key="None", max_retries=0, timeout=120)
            raw = client.chat.completions.with_raw_response.create(model=model, messages=REQUEST, temperature=0,
                                                                   max_tokens=16)
            response = raw.parse()
            assert response.choices[0].finish_reason in ("stop", "length")
            assert response.usage.completion_tokens > 0
            algorithm = flags[flags.index("--speculative-algorithm") + 1]
            assert response.model_extra["speculative"]["algorithm"] == algorithm, (flags, response.model_extra)
        finally:
            assert up.stop() == 0, "\n".join(up.lines[-30:])


def test_every_flag_the_seed_names_is_a_verifier_flag():
    """Every --flag in the seed page (its tables, launch lines and tips) parses in `splitspec verifier`;
    the ones that cannot be honoured are refused at start with the reason, SGLang's backend names map
    to an implemented backend."""
    from splitspec.cli import load_command
    from splitspec.speculation import draft_attention_backend
    from splitspec.model_flags import check_sglang_server_flags

    path = next((p / "speculative_decoding.md" for p in SEEDS if (p / "speculative_decoding.md").is_file()), None)
    if path is None:
        pytest.skip("../shared/seed/speculative_decoding.md is not on this machine (CI always has it)")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", path.read_text()))
    parser = load_command("verifier").build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    assert sorted(named - known) == [], "seed flags the verifier does not parse"
    base = ["--device", "cpu", "--speculative-algorithm", "EAGLE"]
    args = parser.parse_args([*base, "--speculative-draft-attention-backend", "fa3", "--speculative-attention-mode", "decode"])
    assert draft_attention_backend(args) == "auto"  # fa3's kernels are not here: flashinfer on CUDA, torch on CPU
    assert draft_attention_backend(parser.parse_args(base)) == "auto"
    assert draft_attention_backend(parser.parse_args([*base, "--attention-backend", "torch"])) == "torch"
    for refused, flag in ((["--quantization", "awq"], "--quantization awq"), (["--enable-dp-attention"], "--enable-dp-attention"),
                          (["--attention-backend", "flashinfer"], "--attention-backend flashinfer")):
        with pytest.raises(ValueError, match=flag):
            check_sglang_server_flags(parser.parse_args([*base, *refused]), "splitspec verifier")
