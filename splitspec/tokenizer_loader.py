"""A model's tokenizer as the commands read it (`splitspec generate`, `splitspec bench`, the demo's build), torch-free:
`splitspec bench --url` tokenizes its prompts without importing torch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from splitspec.runtime.config import ConfigError

logger = logging.getLogger("splitspec.generate")


def load_tokenizer(path: Path, required: bool):
    """The model's tokenizer. A fast tokenizer (tokenizer.json) is read with `tokenizers` as the gateway reads
    it, so offline and served prompts tokenize alike and no command pays transformers' import (about 3 CPU
    seconds); transformers' AutoTokenizer reads the rest (slow tokenizers, and those whose config asks for
    transformers' clean-up of spaces when decoding)."""
    config = path / "tokenizer_config.json"
    try:
        cleans_up = config.is_file() and bool(json.loads(config.read_text()).get("clean_up_tokenization_spaces"))
    except (OSError, ValueError):
        cleans_up = True  # let transformers read (and refuse) it
    if (path / "tokenizer.json").is_file() and not cleans_up:
        from splitspec.gateway.text import TextCodec

        try:
            return TextCodec(path)
        except Exception as exc:  # noqa: BLE001 (tokenizers raises its own exception types)
            logger.info("tokenizers could not read %s (%s): trying transformers", path, exc)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        if required:
            raise ConfigError(f"no usable tokenizer at {path} ({exc}); pass --tokenizer-path or --input-ids") from exc
        logger.info("no tokenizer at %s: output text is omitted", path)
        return None
