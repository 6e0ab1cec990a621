"""A prepared training set: a byte-level BPE tokenizer trained on the corpus, the corpus as token ids
(train and held-out splits), and the corpus manifest. Training runs read only this directory, so the
same set can be built on one machine and trained on another.

    dataset/
      tokenizer.json, tokenizer_config.json, special_tokens_map.json   (HF format, with a chat template)
      tokens.safetensors        {"train": int32 [N], "held_out": int32 [M]}; files joined by EOS
      corpus_manifest.json      the corpus rule, Python version, every file with its sha256
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from splitspec.train import corpus

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# Conversations render as Python comments, so a model trained only on code continues them with code
# and no special token it has never seen is needed.
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
TOKENS_FILE = "tokens.safetensors"
MANIFEST_FILE = "corpus_manifest.json"


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) with one special token, EOS, which is also BOS and padding.

    Newlines are isolated before the byte-level split, so "\n" is always a token of its own and never
    merges with the next line's indentation: a prompt that ends with a newline then tokenizes as the
    same text did in training, and the model goes on to indent the next line.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_hf_tokenizer(tokenizer, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    ).save_pretrained(out_dir)


def encode_split(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every file's ids followed by EOS, concatenated: [N] int32."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def prepare_dataset(out_dir: Path, vocab_size: int, corpus_root: Path | None = None) -> dict:
    """Builds the dataset directory from this machine's stdlib; returns a summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = corpus.select_files(corpus_root)
    train_texts = corpus.read_texts(files, corpus_root, held_out=False)
    held_out_texts = corpus.read_texts(files, corpus_root, held_out=True)
    logger.info("corpus: %d files (%d held out), %.1f MB", len(files), len(held_out_texts),
                sum(f.num_bytes for f in files) / 1e6)
    tokenizer = train_tokenizer(train_texts, vocab_size)
    save_hf_tokenizer(tokenizer, out_dir)
    splits = {"train": encode_split(tokenizer, train_texts), "held_out": encode_split(tokenizer, held_out_texts)}
    save_file(splits, str(out_dir / TOKENS_FILE))
    corpus.write_manifest(out_dir / MANIFEST_FILE, files)
    summary = {"vocab_size": tokenizer.get_vocab_size(), **{f"{k}_tokens": int(v.numel()) for k, v in splits.items()}}
    logger.info("dataset: %s", summary)
    return summary


def load_tokens(dataset_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.long() for k, v in load_file(str(dataset_dir / TOKENS_FILE)).items()}


def check_manifest(dataset_dir: Path, corpus_root: Path | None = None) -> list[str]:
    """What differs between the dataset's recorded corpus and this machine's."""
    recorded = json.loads((dataset_dir / MANIFEST_FILE).read_text())
    return corpus.compare_manifest(recorded, corpus.select_files(corpus_root))


def vocab_size_of(dataset_dir: Path) -> int:
    return len(json.loads((dataset_dir / "tokenizer.json").read_text())["model"]["vocab"])
