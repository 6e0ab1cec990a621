"""SGLang's and vLLM's serving benchmarks against `splitspec up`, unmodified, as their users run them.

SGLang's: its bench_serving.py
from SGLang's wheel on PyPI (a release whose script runs on its own: aiohttp, numpy, requests, tqdm, transformers,
all in lm-eval-harness's virtualenv, tests/test_lm_eval.py), with the backends that speak OpenAI's API (`vllm` and
`sglang-oai`: /v1/completions, `vllm-chat` and `sglang-oai-chat`: /v1/chat/completions) on its offline random-ids dataset and the
demo target's tokenizer. Every request completes, every completion's tokens are counted as asked, and the accept
length it reads from SGLang's /get_server_info is this server's.

vLLM's: benchmarks/benchmark_serving.py with its backend_request_func.py and benchmark_utils.py, from vLLM's source
release on PyPI (a release whose imports of vllm fall back when vllm is not installed; pillow added to the same
virtualenv), with its `vllm` backend (/v1/completions, streamed, ignore_eos) and `openai-chat` (/v1/chat/completions,
content as a list of parts) on its random dataset: every request completes with the tokens asked."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
import zipfile

import httpx
from test_launcher import Up
from test_lm_eval import lm_eval_venv

from splitspec.demo import demo_model_dirs

SGLANG = "sglang==0.4.10.post2"  # bench_serving.py as a script: no import of the sglang package
VLLM = "0.7.3"  # benchmarks/benchmark_serving.py as a script: its vllm imports fall back
PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 12


def bench_serving(venv, tmp) -> str:
    """SGLang's bench_serving.py, from its wheel (downloaded from PyPI, never installed)."""
    wheels = tmp / "wheels"
    download = subprocess.run([str(venv / "bin/python"), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               SGLANG, "-d", str(wheels)], capture_output=True, text=True, timeout=600)
    assert download.returncode == 0, download.stderr[-3000:]
    with zipfile.ZipFile(next(wheels.glob("sglang-*.whl"))) as wheel:
        script = tmp / "bench_serving.py"
        script.write_bytes(wheel.read("sglang/bench_serving.py"))
    return str(script)


def test_sglang_bench_serving_runs_unmodified_against_the_server(tmp_path):
    venv = lm_eval_venv(tmp_path)
    script = bench_serving(venv, tmp_path)
    target = demo_model_dirs()["target"]
    up = Up("--drafters", "0", "--speculative-algorithm", "NGRAM", "--served-model-name", "demo")
    try:
        up.wait_for_line(r"serving demo at ")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for backend in ("vllm", "vllm-chat", "sglang-oai", "sglang-oai-chat"):
            out = tmp_path / f"{backend}.jsonl"
            run = subprocess.run([str(venv / "bin/python"), script, "--backend", backend, "--base-url", up.url,
                                  "--model", "demo", "--tokenizer", str(target), "--dataset-name", "random-ids",
                                  "--num-prompts", str(PROMPTS), "--random-input-len", str(INPUT_LEN),
                                  "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1.0",
                                  "--max-concurrency", "4", "--output-file", str(out), "--disable-tqdm"],
                                 capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            result = json.loads(out.read_text().splitlines()[-1])
            assert result["completed"] == PROMPTS, (backend, run.stdout[-3000:])
            assert result["output_throughput"] > 0 and result["mean_ttft_ms"] > 0, result
            if not backend.endswith("chat"):  # completions send ignore_eos: every request generates what it asked
                assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN, result
            if backend.startswith("sglang"):  # read from /get_server_info after the run
                info = httpx.get(up.url + "/get_server_info", timeout=30).json()
                assert info["speculative_algorithm"] == "NGRAM" and result["accept_length"] is not None
                assert result["accept_length"] > 1, result
                assert abs(info["internal_states"][0]["avg_spec_accept_length"] - result["accept_length"]) < 0.5
    finally:
        up.stop()


def vllm_benchmark(tmp) -> str:
    """vLLM's benchmark_serving.py and the two modules beside it, from vLLM's source release on PyPI (fetched from the
    package index pip uses, its sha256 checked; never built or installed)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = httpx.get(f"{index}/vllm/", follow_redirects=True, timeout=60)
    page.raise_for_status()
    name = f"vllm-{VLLM}.tar.gz"
    link = re.search(r'href="([^"#]*/%s)#sha256=([0-9a-f]{64})"' % re.escape(name), page.text)
    assert link, f"{name} is not on {index}/vllm/"
    sdist = httpx.get(str(page.url.join(link.group(1))), follow_redirects=True, timeout=600)
    sdist.raise_for_status()
    assert hashlib.sha256(sdist.content).hexdigest() == link.group(2)
    folder = tmp / "vllm_benchmarks"
    folder.mkdir()
    with tarfile.open(fileobj=io.BytesIO(sdist.content)) as tar:
        for module in ("benchmark_serving.py", "backend_request_func.py", "benchmark_utils.py"):
            (folder / module).write_bytes(tar.extractfile(f"vllm-{VLLM}/benchmarks/{module}").read())
    return str(folder / "benchmark_serving.py")


def test_vllm_benchmark_serving_runs_unmodified_against_the_server(tmp_path):
    venv = lm_eval_venv(tmp_path)
    script = vllm_benchmark(tmp_path)
    target = demo_model_dirs()["target"]
    up = Up("--speculative-algorithm", "NGRAM", "--served-model-name", "demo")
    try:
        up.wait_for_line(r"serving demo at ")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for backend, endpoint in (("vllm", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
            run = subprocess.run([str(venv / "bin/python"), script, "--backend", backend, "--base-url", up.url,
                                  "--endpoint", endpoint, "--model", "demo", "--tokenizer", str(target),
                                  "--dataset-name", "random", "--num-prompts", str(PROMPTS),
                                  "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                                  "--random-range-ratio", "1.0", "--max-concurrency", "4", "--ignore-eos",
                                  "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                                  "--result-filename", f"{backend}.json"],
                                 capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            result = json.loads((tmp_path / f"{backend}.json").read_text())
            assert result["completed"] == PROMPTS, (backend, run.stdout[-3000:])
            assert result["total_input_tokens"] > 0 and result["mean_ttft_ms"] > 0, result
            # both send ignore_eos, and count the streamed usage's completion tokens: every request made what it asked
            assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN, result
            assert result["output_throughput"] > 0, result
    finally:
        up.stop()
