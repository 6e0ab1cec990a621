"""Model locations: a local directory, or a Hugging Face hub id resolved through huggingface_hub.

Resolution goes through `snapshot_download`, so the HF cache, `HF_HUB_OFFLINE`, `HF_HOME` and tokens
behave exactly as with transformers; a revision may be a branch, tag or commit.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# what a model directory needs from the hub (weights in safetensors, configs, tokenizer files);
# Mistral repos also carry `consolidated*.safetensors`, the same weights in Mistral's own layout
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
HUB_IGNORE = ["consolidated*", "original/*"]
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_dir(name_or_path: str, revision: str | None = None, flag: str = "--model-path") -> Path:
    """A local directory as is; otherwise `org/name` from the hub (or its local cache when offline).
    `flag` names the option the path came from in errors."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{flag} {name_or_path!r} is a file; give a model directory or a hub id")
    if name_or_path.count("/") != 1 or name_or_path.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{flag} {name_or_path!r}: no such directory, and not a hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    logger.info("resolving %s (revision %s) through huggingface_hub", name_or_path, revision or "main")
    if revision is not None and COMMIT_HASH.match(revision):
        # A commit is immutable: a cached snapshot of it is used without asking the hub (some
        # huggingface_hub versions list the repo first even when offline).
        try:
            return Path(snapshot_download(name_or_path, revision=revision, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            pass
    try:
        return Path(snapshot_download(name_or_path, revision=revision, allow_patterns=HUB_PATTERNS,
                                      ignore_patterns=HUB_IGNORE))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"{flag} {name_or_path!r} (revision {revision or 'main'}): not a local directory and "
            f"could not be resolved on the hub or in the HF cache: {exc}"
        ) from exc


def resolve_file(path_or_hub_file: str, revision: str | None = None) -> Path:
    """A local file as is; otherwise `<org>/<repo>/<file...>` fetched from the hub (SGLang's form for
    --speculative-token-map, e.g. thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt)."""
    path = Path(path_or_hub_file).expanduser()
    if path.is_file():
        return path
    parts = path_or_hub_file.split("/")
    if len(parts) < 3 or path.is_absolute() or path_or_hub_file.startswith((".", "~")) or not all(parts[:2]):
        raise FileNotFoundError(f"{path_or_hub_file}: no such file, and not of the form <org>/<repo>/<file>")
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), revision=revision))
