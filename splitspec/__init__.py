"""splitspec: speculative decoding with drafters as separate services."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

# pyproject's package-dir maps these sub-packages from the repository's top-level folders. An installed
# splitspec (a wheel, or an editable install's finder) has them; a source tree on sys.path does not (a GPU
# image where nothing is pip-installed, or `python -m splitspec` run in the repository's root, which puts
# the root's splitspec/ first): there this finder maps them the same way.
MAPPED_SUBPACKAGES = ("protos", "gateway", "verifier_svc", "drafter_svc", "kernels")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in MAPPED_SUBPACKAGES:
            return None
        folder = os.path.join(self.root, name)
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _map_source_tree() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "drafter_svc")) or not os.path.isfile(os.path.join(root, "drafter_svc", "__init__.py")):
        return  # installed (the sub-packages are inside), or not a source tree
    if not any(isinstance(finder, _SourceTreeFinder) for finder in sys.meta_path):
        sys.meta_path.append(_SourceTreeFinder(root))  # last: an installed finder that knows them goes first
    # `python -m splitspec ...` (how `up` starts its services, and how a user may start one) in the repository's root
    # puts the root on sys.path, where its top-level folders shadow other projects' packages: transformers requires
    # Hugging Face's `kernels`, and with the root's kernels/ found first AutoTokenizer failed to import (structured
    # outputs went unavailable in every service `bash scripts/run.sh up` started from a clone). splitspec is imported
    # by now and finds its sub-packages through its own path: the root leaves sys.path.
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]


_map_source_tree()
