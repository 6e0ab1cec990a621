"""lm-eval-harness against `splitspec up`, as an evaluation user runs it: lm-eval installed from PyPI into its own
virtualenv (scripts/lm_eval_venv.sh; .ci/run starts it while the suite runs), its own `local-completions` client,
two tasks defined here on local JSON files (no hub): a loglikelihood task (multiple choice: completions with echo,
logprobs and max_tokens 1) and a generate-until task. Both run to completion; every loglikelihood lm-eval reports
equals a transformers forward's on the demo target (fp32) within 1e-4, and every generation equals the server's
own greedy completion cut at the task's stop string."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import hf_model
from test_launcher import Up

from splitspec.demo import demo_model_dirs

REPO = Path(__file__).resolve().parent.parent
INSTALL_SECONDS = 1200

LL_DOCS = [{"question": "def add(a, b):\n    return a", "choices": [" + b", " - b", " * b"], "answer": 0},
           {"question": "import os\nimport", "choices": [" sys", " the", " banana"], "answer": 0},
           {"question": "for i in range(10):\n   ", "choices": [" print(i)", " return"], "answer": 0}]
GEN_DOCS = [{"prompt": "def add(a, b):\n", "target": "    return a + b"}, {"prompt": "import os\n", "target": "import sys"}]
TASKS = {
    "tiny_ll": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
               "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\n"
                "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
}


def lm_eval_venv(tmp: Path) -> Path:
    """The virtualenv with lm-eval: the one .ci/run is installing (waited for), or one installed now."""
    named = os.environ.get("SPLITSPEC_LM_EVAL_VENV")
    venv = Path(named) if named else tmp / "lm-eval"
    if not named:
        subprocess.run(["bash", str(REPO / "scripts/lm_eval_venv.sh"), str(venv), sys.executable], check=False,
                       timeout=INSTALL_SECONDS)
    deadline = time.time() + INSTALL_SECONDS
    while not (venv / ".ready").exists():
        if (venv / ".failed").exists() or time.time() > deadline:
            log = Path(f"{venv}.log")
            pytest.fail("installing lm-eval-harness from PyPI failed:\n" + (log.read_text()[-3000:] if log.exists() else ""))
        time.sleep(2)
    return venv


def test_lm_eval_harness_runs_a_loglikelihood_and_a_generate_until_task(tmp_path):
    venv = lm_eval_venv(tmp_path)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, docs in (("tiny_ll", LL_DOCS), ("tiny_gen", GEN_DOCS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {tmp_path / (name + '.jsonl')}\ntest_split: test\n" + TASKS[name])
    target = demo_model_dirs()["target"]
    up = Up("--drafters", "0", "--speculative-algorithm", "NGRAM", "--served-model-name", "demo")
    try:
        up.wait_for_line(r"serving demo at ")
        out = tmp_path / "out"
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        args = (f"model=demo,base_url={up.url}/v1/completions,tokenizer={target},tokenizer_backend=huggingface,"
                "num_concurrent=2,max_retries=1,tokenized_requests=False")
        run = subprocess.run([str(venv / "bin/lm_eval"), "--model", "local-completions", "--model_args", args,
                              "--tasks", "tiny_ll,tiny_gen", "--include_path", str(tasks), "--output_path", str(out),
                              "--log_samples"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        assert results["tiny_ll"]["sample_len"] == len(LL_DOCS) and "acc,none" in results["tiny_ll"]
        assert results["tiny_gen"]["sample_len"] == len(GEN_DOCS) and "exact_match,none" in results["tiny_gen"]
        samples = {name: [json.loads(line) for line in next(out.rglob(f"samples_{name}_*.jsonl")).read_text().splitlines()]
                   for name in ("tiny_ll", "tiny_gen")}
        from transformers import AutoTokenizer

        tokenizer, model = AutoTokenizer.from_pretrained(target), hf_model(target)
        checked = 0
        for sample in samples["tiny_ll"]:
            for request, response in zip(sample["arguments"].values(), sample["resps"]):
                context, continuation = request["arg_0"], request["arg_1"]
                spaces = len(context) - len(context.rstrip())  # lm-eval moves a context's trailing spaces over
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                full, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
                with torch.no_grad():
                    logprobs = model(torch.tensor([full])).logits[0].log_softmax(-1)
                expected = sum(logprobs[j - 1, full[j]].item() for j in range(len(head), len(full)))
                assert abs(float(response[0][0]) - expected) < 1e-4, (context, continuation, response, expected)
                checked += 1
        assert checked == sum(len(d["choices"]) for d in LL_DOCS)
        for sample in samples["tiny_gen"]:
            own = httpx.post(f"{up.url}/v1/completions", timeout=60, json={
                "model": "demo", "prompt": sample["doc"]["prompt"], "max_tokens": 16, "temperature": 0}).json()
            assert sample["resps"][0][0] == own["choices"][0]["text"].split("\n\n")[0]
    finally:
        assert up.stop() == 0
