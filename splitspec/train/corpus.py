"""The demo corpus: the Python standard library's own `.py` files, chosen by a fixed rule.

Rule: every `*.py` under `sysconfig.get_paths()["stdlib"]`, in sorted relative-path order, except
- files under a directory named test, tests, idle_test, site-packages or __pycache__ (Debian and
  container Pythons strip the test suites, so no corpus may depend on them), or config-* (build files);
- `encodings/` (generated code-page tables) and `pydoc_data/` (a documentation text blob);
- `_sysconfigdata*.py` (written per machine at build time).
A file goes to the held-out split when sha256(relative path) is 0 mod 20 (about 5%, stable across
Python versions for files that exist in both).

The manifest records the Python version and each file's sha256; a rebuild compares and says what
differs, so a model trained on one machine's stdlib is traceable on another.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
HELD_OUT_MODULUS = 20


@dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the stdlib root, POSIX separators
    sha256: str
    num_bytes: int

    @property
    def held_out(self) -> bool:
        return int(hashlib.sha256(self.path.encode()).hexdigest(), 16) % HELD_OUT_MODULUS == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_selected(relative: Path) -> bool:
    directories = relative.parts[:-1]
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in directories):
        return False
    return relative.suffix == ".py" and not relative.name.startswith("_sysconfigdata")


def select_files(root: Path | None = None) -> list[CorpusFile]:
    root = root or stdlib_root()
    found = []
    for directory, subdirs, names in os.walk(root):  # excluded directories are not entered (site-packages can be large)
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        base = Path(directory).relative_to(root)
        found += [base / name for name in names if name.endswith(".py")]
    files = []
    for relative in sorted(found, key=lambda p: p.as_posix()):
        path = root / relative
        if path.is_file() and is_selected(relative):
            data = path.read_bytes()
            files.append(CorpusFile(relative.as_posix(), hashlib.sha256(data).hexdigest(), len(data)))
    if not files:
        raise RuntimeError(f"no standard-library .py files found under {root}")
    return files


def manifest(files: list[CorpusFile]) -> dict:
    return {
        "rule": __doc__.split("\n\n")[1].strip(),
        "python_version": platform.python_version(),
        "num_files": len(files),
        "num_bytes": sum(f.num_bytes for f in files),
        "files": [[f.path, f.sha256] for f in files],
    }


def compare_manifest(recorded: dict, files: list[CorpusFile]) -> list[str]:
    """Human-readable differences between a recorded manifest and this machine's corpus."""
    differences = []
    if recorded.get("python_version") != platform.python_version():
        differences.append(f"Python {recorded.get('python_version')} recorded, {platform.python_version()} here")
    then = dict(map(tuple, recorded.get("files", [])))
    now = {f.path: f.sha256 for f in files}
    missing, added = sorted(set(then) - set(now)), sorted(set(now) - set(then))
    changed = sorted(p for p in set(then) & set(now) if then[p] != now[p])
    for label, paths in (("missing here", missing), ("new here", added), ("changed", changed)):
        if paths:
            shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
            differences.append(f"{len(paths)} file(s) {label}: {shown}")
    return differences


def read_texts(files: list[CorpusFile], root: Path | None = None, held_out: bool | None = None) -> list[str]:
    """File contents (UTF-8, undecodable bytes replaced), optionally only one split."""
    root = root or stdlib_root()
    chosen = [f for f in files if held_out is None or f.held_out == held_out]
    return [(root / f.path).read_bytes().decode("utf-8", errors="replace") for f in chosen]


def write_manifest(path: Path, files: list[CorpusFile]) -> None:
    path.write_text(json.dumps(manifest(files), indent=1) + "\n")
