"""The training text of a draft head in its target's tokenizer (`splitspec train eagle|eagle3 --data`): files,
directories, this machine's Python standard library or a dataset prepared for `train lm`, split into training and
held-out token ids and cached by content."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)


def load_text_tokens(data: list[str], target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of the training text in the target's tokenizer, documents joined by
    its EOS. `data`: files and directories (every file below, sorted; every 20th file held out, or the
    last 5% of the tokens when there is one file), `stdlib` for this machine's Python standard library
    (the demo models' corpus, its own held-out files), or a dataset directory prepared for `train lm`
    (tokens.safetensors in the target's tokenizer: the demo models' exact data)."""
    from tokenizers import Tokenizer

    from splitspec.runtime.config import ModelConfig
    from splitspec.train import corpus

    from splitspec.train.dataset import TOKENS_FILE, load_tokens

    if len(data) == 1 and (Path(data[0]) / TOKENS_FILE).is_file():  # a dataset prepared for `train lm`
        dataset = Path(data[0])
        mine, theirs = (json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
                        for d in (dataset, Path(target_dir)))
        if mine != theirs:
            raise ValueError(f"--data {dataset}: its tokenizer is not the target's")
        splits = load_tokens(dataset)
        return splits["train"], splits["held_out"]
    tokenizer_file = Path(target_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{tokenizer_file}: the target needs a tokenizer.json to tokenize --data")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = (ModelConfig.from_dir(target_dir).eos_token_ids or (None,))[0]
    if data == ["stdlib"]:
        files = corpus.select_files()
        splits = (corpus.read_texts(files, held_out=False), corpus.read_texts(files, held_out=True))
    else:
        paths: list[Path] = []
        for item in data:
            path = Path(item)
            if path.is_dir():
                paths += sorted(p for p in path.rglob("*") if p.is_file())
            elif path.is_file():
                paths.append(path)
            else:
                raise ValueError(f"--data {item}: no such file or directory")
        if not paths:
            raise ValueError(f"--data {' '.join(data)}: no files")
        texts = [p.read_bytes().decode("utf-8", errors="replace") for p in paths]
        if len(texts) == 1:
            splits = (texts, [])
        else:
            splits = ([t for i, t in enumerate(texts) if i % corpus.HELD_OUT_MODULUS != corpus.HELD_OUT_MODULUS - 1],
                      [t for i, t in enumerate(texts) if i % corpus.HELD_OUT_MODULUS == corpus.HELD_OUT_MODULUS - 1])
    train, held_out = _encode_cached(tokenizer, tokenizer_file, eos, splits)
    if held_out.numel() == 0:  # one file: its last 5% is held out
        cut = int(train.numel() * 0.95)
        train, held_out = train[:cut], train[cut:]
    return train, held_out


def token_cache_dir() -> Path:
    return Path(os.environ.get("SPLITSPEC_TOKEN_CACHE") or Path.home() / ".cache" / "splitspec" / "tokens")


def _encode_cached(tokenizer, tokenizer_file: Path, eos: int | None, splits) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's texts encoded and joined by EOS. The result is cached under token_cache_dir(), keyed by
    the sha256 of the tokenizer file, the EOS id and every text (any change tokenizes again): the standard
    library is ~3M tokens, seconds of CPU per run otherwise."""
    from safetensors.torch import load_file

    key = hashlib.sha256(tokenizer_file.read_bytes())
    key.update(f"eos={eos}".encode())
    for texts in splits:
        key.update(f"split of {len(texts)}".encode())
        for text in texts:
            key.update(hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest())
    cached = token_cache_dir() / f"{key.hexdigest()}.safetensors"
    if cached.is_file():
        try:
            tensors = load_file(cached)
            logger.info("token ids from the cache %s", cached)
            return tensors["train"], tensors["held_out"]
        except Exception as exc:  # noqa: BLE001 (a torn or foreign file: tokenize again)
            logger.warning("unreadable token cache %s (%s): tokenizing again", cached, exc)
    encoded = []
    for texts in splits:
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids.extend(encoding.ids)
            if eos is not None:
                ids.append(eos)
        encoded.append(torch.tensor(ids, dtype=torch.long))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
        save_file({"train": encoded[0], "held_out": encoded[1]}, partial)
        os.replace(partial, cached)  # whole or absent, also with two writers
    except OSError as exc:
        logger.info("token ids not cached (%s)", exc)
    return encoded[0], encoded[1]
