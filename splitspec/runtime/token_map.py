"""FR-Spec token maps (REFERENCES §6): the draft's head is cut to a list of frequent target token ids,
and drafted indices are mapped back through that list. Verification still uses the full vocabulary, so
the output does not change; drafting over fewer rows is cheaper.

The file is what FR-Spec publishes: a Python list of token ids (or a 1-D integer tensor) saved with
torch.save, most frequent first; --speculative-token-map takes a path or `<org>/<repo>/<file>`.
"""

from __future__ import annotations

import torch

from splitspec.runtime.hub import resolve_file


class TokenMapError(ValueError):
    """A token map that cannot be used with this target."""


def load_token_map(path_or_hub_file: str, vocab_size: int) -> torch.Tensor:
    """The hot token ids (int64 [R]), checked against the target's vocabulary."""
    path = resolve_file(path_or_hub_file)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise TokenMapError(f"{path}: not a token map saved with torch.save ({exc})") from None
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.dtype.is_floating_point:
            raise TokenMapError(f"{path}: a token map is a 1-D list of integer ids, got {data.dtype} {tuple(data.shape)}")
        ids = data.to(torch.int64)
    elif isinstance(data, (list, tuple)) and all(isinstance(t, int) for t in data):
        ids = torch.tensor(data, dtype=torch.int64)
    else:
        raise TokenMapError(f"{path}: a token map is a list of integer token ids")
    if ids.numel() == 0:
        raise TokenMapError(f"{path}: the token map is empty")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise TokenMapError(f"{path}: token ids {bad[:5].tolist()} are outside the target's vocabulary [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise TokenMapError(f"{path}: the token map lists some ids twice")
    return ids
