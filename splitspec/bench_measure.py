"""What `splitspec bench` measures on both sides (in process and over HTTP): the prompts of a load, each
request's token timeline and the latency fields of a row, and the commit a report names."""

from __future__ import annotations

import json
import logging
import random
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("splitspec.bench")


def ints(text: str | None) -> list[int | None]:
    return [None] if text is None else [int(x) for x in text.split(",") if x.strip()]


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": round(statistics.fmean(values) * 1e3, 3), "p50": round(at(0.5) * 1e3, 3),
            "p90": round(at(0.9) * 1e3, 3), "p99": round(at(0.99) * 1e3, 3)}


@dataclass
class Timeline:
    """One request: when it was sent, and each delivery (time, tokens)."""

    sent: float = 0.0
    deliveries: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.deliveries)


def latency_fields(timelines: list[Timeline], wall: float) -> dict:
    done = [t for t in timelines if t.deliveries]
    tokens = sum(t.tokens for t in done)
    itl = [b[0] - a[0] for t in done for a, b in zip(t.deliveries, t.deliveries[1:])]
    speeds = [(t.tokens - 1) / (t.deliveries[-1][0] - t.deliveries[0][0])
              for t in done if t.tokens > 1 and t.deliveries[-1][0] > t.deliveries[0][0]]
    tpot = [(t.deliveries[-1][0] - t.deliveries[0][0]) / (t.tokens - 1) for t in done if t.tokens > 1]
    return {"requests": len(timelines), "completed": len(done), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "per_request_tok_s": round(statistics.fmean(speeds), 2) if speeds else None,
            "ttft_ms": percentiles([t.deliveries[0][0] - t.sent for t in done]), "itl_ms": percentiles(itl),
            "tpot_ms": round(statistics.fmean(tpot) * 1e3, 3) if tpot else None}


def drafted_token_share(verify_steps: int, accepted_tokens: int, output_tokens: int) -> float | None:
    """The share of a point's output tokens that drafted steps made (each verify with drafts: its accepted drafts and
    the bonus token); the rest came from steps without a tree (the prompt's step, drafting off, no match). A speedup
    over plain decoding is speculation's only where this is large: with the load-adaptive policy's drafting off it
    measures undrafted steps. Capped at 1: a request's last step may accept drafts past its max_tokens, which the
    counts keep and the output does not."""
    return round(min((verify_steps + accepted_tokens) / output_tokens, 1.0), 4) if output_tokens else None


# prompts -------------------------------------------------------------------------------------------
def make_prompts(args, model_dir: Path | None, vocab_size: int | None, count: int) -> list:
    """Token-id lists (texts for --url with held-out prompts, which the server tokenizes)."""
    dataset = args.dataset
    tokenizer = None
    if dataset in ("auto", "held-out") and model_dir is not None:
        from splitspec.tokenizer_loader import load_tokenizer

        tokenizer = load_tokenizer(model_dir, required=dataset == "held-out")
    if dataset == "auto":
        dataset = "held-out" if tokenizer is not None or (args.url and model_dir is None) else "random"
    if dataset == "random":
        if vocab_size is None:
            raise ValueError("--dataset random needs the model's vocabulary: not available with --url")
        rng = random.Random(args.seed)
        return [[rng.randrange(vocab_size) for _ in range(args.prompt_len)] for _ in range(count)]
    if dataset == "held-out":
        from splitspec.train import corpus

        texts = corpus.read_texts([f for f in corpus.select_files() if f.held_out], held_out=True)
        # every text's first window, then (where more prompts are asked for than there are texts: --rounds) the
        # windows after it, so that prompts repeat only once the texts are used up
        if tokenizer is None:  # the server tokenizes: cut by characters (about 4 per token)
            width = 4 * args.prompt_len
            windows = [[t[i : i + width] for i in range(0, len(t) - width + 1, width)] for t in texts]
        else:
            width = args.prompt_len
            windows = [[ids[i : i + width] for i in range(0, len(ids) - width + 1, width)]
                       for ids in (tokenizer.encode(t[: 16 * args.prompt_len * -(-count // len(texts))]) for t in texts)]
        prompts = []
        for k in range(max(map(len, windows), default=0)):
            prompts += [w[k] for w in windows if len(w) > k]
            if len(prompts) >= count:
                break
    else:
        rows = [json.loads(line) for line in Path(dataset).read_text().splitlines() if line.strip()]
        prompts = [r["prompt_ids"] if "prompt_ids" in r else r.get("text") or r["prompt"] for r in rows]
        if tokenizer is None and model_dir is not None and any(isinstance(p, str) for p in prompts):
            from splitspec.tokenizer_loader import load_tokenizer

            tokenizer = load_tokenizer(model_dir, required=True)
        prompts = [tokenizer.encode(p)[: args.prompt_len] if isinstance(p, str) and tokenizer is not None else p
                   for p in prompts]
    if not prompts:
        raise ValueError(f"--dataset {args.dataset}: no prompts of {args.prompt_len} tokens")
    return [prompts[i % len(prompts)] for i in range(count)]


def round_prompts(prompts: list, counts: dict[int, int], round_: int) -> dict[int, list]:
    """Each batch size's prompts in this round: every (round, batch size) its own slice of the dataset's order, round
    after round, a round's batch sizes in order, so that no point sends what another sent (a drafter that learns from
    what it served, NGRAM's trie, would meet those answers again). `prompts` holds at least prompts_for(counts, R)."""
    at = round_ * sum(counts.values())
    out = {}
    for batch_size, count in counts.items():
        out[batch_size], at = prompts[at: at + count], at + count
    return out


def prompts_for(counts: dict[int, int], rounds: int) -> int:
    """How many prompts round_prompts takes for rounds 0..rounds-1."""
    return rounds * sum(counts.values())


# in process ----------------------------------------------------------------------------------------


def git_commit(directory: Path | None = None) -> str | None:
    """$SPLITSPEC_COMMIT (set it where the copy's .git is not the checkout's: the GPU machine), else the HEAD
    of the checkout holding `directory` (default: this package)."""
    import os

    if os.environ.get("SPLITSPEC_COMMIT"):
        return os.environ["SPLITSPEC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=directory or Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
