"""No import circles among the product's modules: the graph of every import a module makes, at its top or
inside a function (a deferred import is still a dependency), read from the source of the packages
pyproject.toml maps, has no cycle."""

from __future__ import annotations

import ast
import gc
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def product_modules() -> dict[str, Path]:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in mapping.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if "demo_models" in parts:
                continue
            name = ".".join([package, *parts[:-1]] if parts[-1] == "__init__" else [package, *parts])
            modules.setdefault(name, path)  # splitspec/ maps once; the nested packages' own entries win below
    for package, folder in mapping.items():  # a mapped folder's modules are named by its package
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            name = ".".join([package, *parts[:-1]] if parts[-1] == "__init__" else [package, *parts])
            modules[name] = path
    return modules


def parse(path: Path) -> ast.Module:
    """ast.parse with the collector held off (collections wait until after it): on CPython 3.11.7 a finalizer run by a collection inside the parse (an
    asyncio task logging its traceback, which parses source for its carets) re-enters the AST constructor and the parse
    fails with "AST constructor recursion depth mismatch" (cpython gh-106905; a CI run failed so)."""
    gc.disable()
    try:
        return ast.parse(path.read_text(), filename=str(path))
    finally:
        gc.enable()


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = parse(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    resolved = set()
    for target in found:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_the_products_modules():
    modules = product_modules()
    assert {"splitspec.runtime.sampling", "splitspec.kernels.ops", "splitspec.verifier_svc.engine",
            "splitspec.gateway.app"} <= set(modules)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "splitspec.kernels.ops" in graph["splitspec.runtime.sampling"]  # deferred imports are read too
    assert [sorted(c) for c in cycles(graph)] == []


# the layers (issue 32): the engine's parts below the services, the services below the command lines ---------------
ENGINE = ("splitspec.runtime", "splitspec.kernels", "splitspec.protos")
SERVICES = ("splitspec.drafter_svc", "splitspec.verifier_svc", "splitspec.gateway")
# process-level utilities every layer may use (no flags, no models, no services)
UTILITIES = {"splitspec.registry", "splitspec.device_profile", "splitspec.default_model", "splitspec.heap",
             "splitspec.host_profile", "splitspec.step_log", "splitspec.sync_debug", "splitspec.lifeline", "splitspec.event_loop",
             "splitspec.metrics_http", "splitspec.metric_tally", "splitspec.model_shapes", "splitspec.log_format", "splitspec"}
# where command-line flags become configuration: only a command line (a service's server.py, or its flags.py, which
# `splitspec up` and `--help` read without the service) imports these
FLAG_MODULES = {"splitspec.model_flags", "splitspec.engine_args", "splitspec.draft_models", "splitspec.speculation",
                "splitspec.generate", "splitspec.generate_flags"}
COMMAND_LINES = {"splitspec.drafter_svc.server", "splitspec.drafter_svc.flags", "splitspec.verifier_svc.server",
                 "splitspec.verifier_svc.flags", "splitspec.gateway.server", "splitspec.gateway.worker"}


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def layering_faults(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up: an engine module importing a service, a command line or a flag module; a service
    module importing anything above the engine but the utilities, or, outside its command line, a flag module; any
    other top-level module (not classified as a utility above)."""
    faults = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if _in(name, ENGINE):
                ok = _in(target, ENGINE) or target in UTILITIES
            elif _in(name, SERVICES):
                ok = (_in(target, ENGINE + SERVICES) or target in UTILITIES) and (
                    target not in FLAG_MODULES or name in COMMAND_LINES) or (name in COMMAND_LINES and target in FLAG_MODULES)
            else:
                continue  # the command lines and the trainer sit on top
            if not ok:
                faults.append(f"{name} -> {target}")
    return faults


def test_the_layering_check_finds_an_upward_import():
    graph = {"splitspec.runtime.runner": {"splitspec.verifier_svc.engine", "splitspec.heap"},
             "splitspec.verifier_svc.engine": {"splitspec.engine_args", "splitspec.runtime.runner"},
             "splitspec.verifier_svc.server": {"splitspec.engine_args"},
             "splitspec.gateway.app": {"splitspec.bench"}}
    assert layering_faults(graph) == ["splitspec.gateway.app -> splitspec.bench",
                                      "splitspec.runtime.runner -> splitspec.verifier_svc.engine",
                                      "splitspec.verifier_svc.engine -> splitspec.engine_args"]


def test_packages_depend_downward_only():
    """runtime, kernels and protos import no service, command line or flag module; the drafter, the verifier and the
    gateway import the engine, each other and the utilities, and only their command lines read the flag modules."""
    modules = product_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert {"splitspec.engine_args", "splitspec.model_flags"} <= graph["splitspec.verifier_svc.server"]
    assert "splitspec.runtime.runner" in graph["splitspec.verifier_svc.engine"]
    assert layering_faults(graph) == []
