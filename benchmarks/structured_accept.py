"""Accept length and speed under a JSON schema next to unconstrained decoding (issue 33): the demo target in this
process with each drafter, the same prompts greedy, constrained by --schema (default: a small object) and not;
how many constrained outputs validate, and whether speculation changed any output. JSON out, no assertions:

    python -P benchmarks/structured_accept.py --algorithms NGRAM,EAGLE3 --out structured.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from splitspec.demo import QUALITY_PROMPTS, demo_model_dirs
from splitspec.runtime.grammar import Compiler
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import Engine, SpecConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 4},
                                           "size": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "tags", "size", "ok"]}


def drafter(algorithm: str, runner, device: str):
    import argparse as ap

    from splitspec import engine_args
    from splitspec.draft_models import build_drafter, capture_for
    from splitspec.speculation import resolve
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    parser = ap.ArgumentParser()
    engine_args.add_speculative_args(parser, side="drafter")
    for flag, default in (("--dtype", "float32"), ("--device", device), ("--page-size", 16), ("--max-total-tokens", 16384),
                          ("--attention-backend", "torch"), ("--model-path", str(demo_model_dirs()["target"]))):
        parser.add_argument(flag, default=default, type=type(default))
    heads = demo_model_dirs(heads=True) if algorithm in ("EAGLE", "EAGLE3") else {}
    path = {"STANDALONE": demo_model_dirs()["draft"], "EAGLE": heads.get("eagle"), "EAGLE3": heads.get("eagle3")}.get(algorithm)
    argv = ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", "8"]
    if path is not None:
        argv += ["--speculative-draft-model-path", str(path), "--speculative-num-steps", "4", "--speculative-eagle-topk", "2"]
    built = build_drafter(resolve(parser.parse_args(argv), runner.config), target=runner)
    capture_for(runner, built.hidden_state_layers)
    topk = 1 if algorithm == "NGRAM" else 2
    return InProcessDrafterClient(built), SpecConfig(num_draft_tokens=8, num_steps=7 if algorithm == "NGRAM" else 4, topk=topk)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def _valid(texts: list[str], schema: dict) -> int | None:
    """How many texts are JSON valid under the schema (jsonschema, the tests' validator)."""
    try:
        import jsonschema
    except ImportError:
        return None
    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
            ok += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return ok


def run(engine: Engine, prompts, params) -> tuple[list, float]:
    began = time.perf_counter()
    requests = engine.run(prompts, [params] * len(prompts))
    return requests, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="NGRAM", help="Comma-separated: NGRAM, STANDALONE, EAGLE, EAGLE3.")
    parser.add_argument("--schema", default=None, help="A JSON Schema file (default: a small object).")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    target = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    schema = json.loads(open(args.schema).read()) if args.schema else SCHEMA
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device=args.device,
                                            max_total_tokens=16384, page_size=16))
    eos = {tokenizer.eos_token_id}
    compiler = Compiler(tokenizer, runner.config.vocab_size, eos)
    prompts = [tokenizer.encode(QUALITY_PROMPTS[i % len(QUALITY_PROMPTS)]) for i in range(args.num_prompts)]
    rows = []
    for algorithm in args.algorithms.split(","):
        client, spec = drafter(algorithm, runner, args.device)
        for constrained in (False, True):
            params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens,
                                    grammar=("json_schema", json.dumps(schema)) if constrained else None)
            plain, plain_s = run(Engine(runner, None, SpecConfig(), eos, grammars=compiler), prompts, params)
            speculated, spec_s = run(Engine(runner, client, spec, eos, grammars=compiler), prompts, params)
            steps = sum(r.stats.verify_steps for r in speculated)
            row = {"algorithm": algorithm, "constrained": constrained,
                   "accept_length": round(1 + sum(r.stats.accepted_tokens for r in speculated) / max(steps, 1), 3),
                   "draft_tokens": sum(r.stats.draft_tokens for r in speculated),
                   "plain_tok_s": round(sum(len(r.output_ids) for r in plain) / plain_s, 1),
                   "speculative_tok_s": round(sum(len(r.output_ids) for r in speculated) / spec_s, 1),
                   "outputs_equal_plain": sum(a.output_ids == b.output_ids for a, b in zip(plain, speculated)),
                   "outputs": len(prompts)}
            if constrained:
                texts = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in speculated]
                row["parsed_outputs"] = sum(_parses(text) for text in texts)
                row["valid_outputs"] = _valid(texts, schema)  # None where jsonschema is not installed (the GPU image)
                row["finished_stop"] = sum(r.finish_reason == "stop" for r in speculated)
            rows.append(row)
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"benchmark": "structured_accept", "commit": commit, "device": args.device, "schema": schema,
              "command": "python -P benchmarks/structured_accept.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
              "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
