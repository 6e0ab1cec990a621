"""A training run's resumable state: what `--resume` (and a rerun after an interruption) continues from. One file
beside the run's outputs, written whole or not at all (a temporary file, then a rename), removed once the run has
saved its results."""

from __future__ import annotations

from pathlib import Path

import torch

STATE_FILE = "train_state.pt"


def save_state(out_dir: Path, state: dict) -> None:
    """Tensors, optimizer state, counters and lists only: load_state reads it back with weights_only."""
    tmp = out_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out_dir / STATE_FILE)


def load_state(out_dir: Path, device: torch.device) -> dict | None:
    """The saved state with its tensors on device, or None when there is none."""
    path = out_dir / STATE_FILE
    if not path.is_file():
        return None
    return torch.load(path, map_location=device, weights_only=True)


def clear_state(out_dir: Path) -> None:
    (out_dir / STATE_FILE).unlink(missing_ok=True)
