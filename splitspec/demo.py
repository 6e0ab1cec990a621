"""`splitspec demo-models`: the demo target and standalone draft every command serves by default, and
the target's EAGLE-2 and EAGLE-3 heads.

The models are trained by `splitspec train lm` on the Python standard library, the heads by `splitspec
train eagle|eagle3` on the same data for the target, and all are shipped in the package
(`splitspec/demo_models/`, safetensors shards under 20 MiB, with `manifest.json`: corpus, command,
seeds, metrics, file hashes). When the shipped files are missing or do not match the manifest they
are rebuilt with the same settings: in the package directory when it is writable, otherwise in a
cache directory; a file lock keeps concurrent commands from building twice.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("splitspec.demo")

SHIPPED_ROOT = Path(__file__).parent / "demo_models"
MANIFEST = "manifest.json"
MODELS = {"target": "demo-target", "draft": "demo-draft"}  # demo name -> training preset (train/presets.py)
HEADS = {"eagle": "demo-eagle", "eagle3": "demo-eagle3"}  # the target's draft heads -> head preset
BUILD_COMMAND = "splitspec demo-models --build"

# Fixed prompts of the code-completion check: greedy completions must compile() up to their last line.
QUALITY_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def read_lines(filename):\n    with open(filename) as f:\n",
    "from collections import defaultdict\n\n\ndef group_by_key(pairs):\n",
    "def is_prime(n):\n    if n < 2:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "for i in range(10):\n",
    "if __name__ == '__main__':\n",
    "def parse_args(argv=None):\n    import argparse\n",
)
QUALITY_NEW_TOKENS = 64


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "splitspec" / "demo-models"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_files(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name != "training.json")


def is_complete(root: Path, section: str = "models") -> bool:
    """Every file the manifest lists in a section ("models": target and draft; "heads": the target's
    draft heads) exists with its recorded sha256."""
    names = MODELS if section == "models" else HEADS
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        return all(
            sha256_file(root / name / file) == digest
            for name in names
            for file, digest in manifest[section][name]["files"].items()
        )
    except (OSError, KeyError, ValueError):
        return False


def corpus_differences(root: Path) -> list[str]:
    """How this machine's standard-library corpus differs from the one recorded under root."""
    from splitspec.train import corpus
    from splitspec.train.dataset import MANIFEST_FILE

    recorded = root / MANIFEST_FILE
    if not recorded.is_file():
        return []
    return corpus.compare_manifest(json.loads(recorded.read_text()), corpus.select_files())


def is_writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK)


@contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def code_completion_quality(model_dir: Path, device: str = "cpu") -> list[dict]:
    """Greedy completions of QUALITY_PROMPTS on the splitspec runtime, each with whether it compiles."""
    from splitspec.generate import generate_ids, load_tokenizer
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig
    from splitspec.runtime.sampling_params import SamplingParams

    tokenizer = load_tokenizer(Path(model_dir), required=True)
    prompts = [tokenizer.encode(p) for p in QUALITY_PROMPTS]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(model_dir), device=device, dtype="float32",
                                            max_total_tokens=len(prompts) * 256))
    params = [SamplingParams(temperature=0.0, max_new_tokens=QUALITY_NEW_TOKENS)] * len(prompts)
    gens = generate_ids(runner, prompts, params, eos_ids={tokenizer.eos_token_id})
    results = []
    for prompt, gen in zip(QUALITY_PROMPTS, gens):
        completion = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        results.append({"prompt": prompt, "completion": completion, "compiles": compiles_to_last_line(prompt + completion)})
    return results


def compiles_to_last_line(text: str) -> bool:
    """Whether `text` up to its last complete line (its last newline) is valid Python."""
    complete = text[: text.rfind("\n") + 1]
    try:
        compile(complete, "<completion>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def build(root: Path, device: str, dataset: Path | None = None, time_budget_s: float = 0.0,
          command: str = BUILD_COMMAND, presets: dict[str, str] = MODELS, head_presets: dict[str, str] = HEADS) -> None:
    """Train the demo models into root (a dataset is prepared beside them unless given). A time
    budget is split between the models (target 2/3, draft 1/3); a model that runs out of time keeps
    its best evaluated weights and its report says so."""
    from splitspec.train.cli import train_lm
    from splitspec.train.dataset import MANIFEST_FILE
    from splitspec.train.presets import DEMO_VOCAB_SIZE, PRESETS

    import dataclasses

    root.mkdir(parents=True, exist_ok=True)
    for difference in corpus_differences(SHIPPED_ROOT):
        logger.warning("this machine's corpus differs from the one the shipped demo models were trained on: %s", difference)
    dataset = dataset or root / "dataset"
    models = {}
    shares = {"target": 2 / 3, "draft": 1 / 3}
    for name, preset in presets.items():
        shape, cfg = PRESETS[preset]
        cfg = dataclasses.replace(cfg, device=device, time_budget_s=time_budget_s * shares[name])
        report = train_lm(root / name, dataset, DEMO_VOCAB_SIZE, shape, cfg)
        models[name] = {"preset": preset, "training": report}
    shutil.copy(dataset / MANIFEST_FILE, root / MANIFEST_FILE)
    quality = code_completion_quality(root / "target", device="cpu")
    for name in MODELS:
        models[name]["files"] = {f: sha256_file(root / name / f) for f in model_files(root / name)}
    manifest = {
        "command": command,
        "corpus_manifest": MANIFEST_FILE,
        "python_version_of_corpus": json.loads((root / MANIFEST_FILE).read_text())["python_version"],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quality": {"prompts_compiling": sum(r["compiles"] for r in quality), "of": len(quality), "completions": quality},
        "models": models,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if head_presets:
        build_heads(root, device, dataset, time_budget_s=0.0, command=command, presets=head_presets)
    if (root / "dataset").exists() and dataset == root / "dataset":
        shutil.rmtree(root / "dataset")  # token ids are rebuilt in seconds; not shipped


def build_heads(root: Path, device: str, dataset: Path | None = None, time_budget_s: float = 0.0,
                command: str = BUILD_COMMAND + " --heads", presets: dict[str, str] = HEADS) -> None:
    """Train the target's draft heads (root/target) into root/eagle and root/eagle3 on the demo dataset
    (prepared beside them unless given) and record them under the manifest's "heads"."""
    import dataclasses

    from splitspec.train.dataset import TOKENS_FILE, prepare_dataset
    from splitspec.train.heads import HeadTrainer
    from splitspec.train.text_tokens import load_text_tokens
    from splitspec.train.presets import DEMO_VOCAB_SIZE, HEAD_PRESETS

    dataset = dataset or root / "dataset"
    if not (dataset / TOKENS_FILE).is_file():
        prepare_dataset(dataset, DEMO_VOCAB_SIZE)
    train, held_out = load_text_tokens([str(dataset)], root / "target")
    heads = {}
    for name, preset in presets.items():
        cfg = dataclasses.replace(HEAD_PRESETS[preset], device=device, time_budget_s=time_budget_s / len(presets))
        report = HeadTrainer(root / "target", root / name, train, held_out, cfg).train()
        report["target"] = "target"  # relative to the demo root
        (root / name / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        heads[name] = {"preset": preset, "command": command, "training": report,
                       "files": {f: sha256_file(root / name / f) for f in model_files(root / name)}}
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["heads"] = heads
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if (root / "dataset").exists() and dataset == root / "dataset":
        shutil.rmtree(root / "dataset")


def demo_model_dirs(cache_dir: Path | None = None, device: str = "auto", presets: dict[str, str] = MODELS,
                    heads: bool = False, head_presets: dict[str, str] = HEADS) -> dict[str, Path]:
    """{"target": dir, "draft": dir} (with heads, also "eagle" and "eagle3"): the shipped models, or ones
    rebuilt where they can be written (the package directory, else the cache directory); a file lock
    lets one process build at a time. Heads alone are retrained when only they are missing, and only
    when asked for."""
    names = (*MODELS, *HEADS) if heads else tuple(MODELS)
    if is_complete(SHIPPED_ROOT) and (not heads or is_complete(SHIPPED_ROOT, "heads")):
        return {name: SHIPPED_ROOT / name for name in names}
    root = SHIPPED_ROOT if is_writable(SHIPPED_ROOT.parent) else (cache_dir or default_cache_dir())
    with file_lock(root.parent / f".{root.name}.lock"):
        built = False
        if not is_complete(root):
            if root != SHIPPED_ROOT and is_complete(SHIPPED_ROOT) and presets == MODELS:  # heads only are missing
                for name in MODELS:
                    shutil.copytree(SHIPPED_ROOT / name, root / name, dirs_exist_ok=True)
                shutil.copy(SHIPPED_ROOT / MANIFEST, root / MANIFEST)
            else:
                logger.warning("demo models missing or changed under %s: rebuilding them (this trains two models%s)",
                               root, " and two heads" if heads else "")
                build(root, _device(device), command=f"{BUILD_COMMAND} (automatic rebuild, device {_device(device)})",
                      presets=presets, head_presets=head_presets if heads else {})
                built = True
        if heads and not is_complete(root, "heads"):
            logger.warning("demo heads missing or changed under %s: training them for the target", root)
            build_heads(root, _device(device), command=f"{BUILD_COMMAND} --heads (automatic rebuild, device "
                        f"{_device(device)})", presets=head_presets)
            built = True
        if not built:
            logger.info("demo models found under %s", root)
    return {name: root / name for name in names}


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec demo-models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true",
                        help='Print {"target": DIR, "draft": DIR, "eagle": DIR, "eagle3": DIR} as JSON.')
    parser.add_argument("--build", action="store_true", help="Train the demo models and heads afresh (into --out, or in place).")
    parser.add_argument("--heads", action="store_true",
                        help="With --build: train only the target's EAGLE and EAGLE3 heads, for the target already there.")
    parser.add_argument("--out", default=None, help="Where --build writes (default: the package's demo_models/).")
    parser.add_argument("--dataset", default=None, help="With --build: a prepared dataset to train on (see train lm).")
    parser.add_argument("--device", default="auto", help="Training device for a build: cpu, cuda; auto = cuda when available.")
    parser.add_argument("--time-budget", type=float, default=0.0, help="With --build: seconds of training in all "
                        "(0 = the presets' full step counts); a model out of time keeps its best weights.")
    parser.add_argument("--cache-dir", default=None, help="Where to rebuild when the package directory is read-only "
                        "(default ~/.cache/splitspec/demo-models).")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="Logging level.")
    return parser


def run(args: argparse.Namespace) -> int:
    from splitspec.log_format import setup_logging

    setup_logging(args.log_level)
    if args.build:
        root = Path(args.out) if args.out else SHIPPED_ROOT
        command = " ".join(["splitspec", "demo-models", *sys.argv[2:]])
        dataset = Path(args.dataset) if args.dataset else None
        with file_lock(root.parent / f".{root.name}.lock"):
            if args.heads:
                build_heads(root, _device(args.device), dataset, args.time_budget, command=command)
            else:
                build(root, _device(args.device), dataset, args.time_budget, command=command)
        dirs = {name: root / name for name in (*MODELS, *HEADS)}
    else:
        dirs = demo_model_dirs(Path(args.cache_dir) if args.cache_dir else None, args.device, heads=True)
    if args.json:
        print(json.dumps({name: str(path) for name, path in dirs.items()}))
    else:
        for name, path in dirs.items():
            print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
