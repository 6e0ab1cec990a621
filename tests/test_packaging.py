"""ARCHITECTURE.md §7: one import root.

The card's top-level folders (`gateway/`, `kernels/`, `protos/`, ...) are mapped into `splitspec` by
pyproject's setuptools `package-dir`. This proves, for real, that after `pip install .` and after
`pip install -e .`:

* `import gateway`, `import kernels`, `import protos` (and the other mapped folder names) do not
  resolve to our code: ModuleNotFoundError, or some other project's package outside this repo;
* `splitspec` and every package pyproject lists (`splitspec.gateway`, `splitspec.kernels`,
  `splitspec.protos`, `splitspec.runtime`, ...) import from the installed location.

Each mode installs a copy of the project (the build writes build/ and *.egg-info next to the sources,
and an editable install must point somewhere we own) into a fresh venv under tmp_path, offline:
`pip install --no-deps --no-index --no-build-isolation`. The venv reuses the running environment's
packages (pip, setuptools, torch, ...) through a folder of symlinks listed in a .pth file, leaving
out anything of splitspec's, so an editable or regular splitspec install in the outer environment
(CI's own `pip install -e .`) can neither satisfy nor mask the check. (`venv --system-site-packages`
would not do: from inside a venv it exposes the base interpreter's site-packages, not the venv's.)
Checks run in that venv's python with -I, from a folder outside the repo.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from splitspec import lifeline


REPO = Path(__file__).resolve().parents[1]

_SETUPTOOLS_CFG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = dict(_SETUPTOOLS_CFG.get("package-dir", {}))
PACKAGES: list[str] = list(_SETUPTOOLS_CFG["packages"])

# Names that must never import as our code at top level: every folder mapped under `splitspec`
# (the ones §7 names first), plus `runtime`, which lives inside splitspec/.
MAPPED_FOLDERS = sorted({p.split("/")[0] for p in PACKAGE_DIR.values()} - {"splitspec", ""})
TOP_LEVEL_NAMES = ["kernels", "protos", "gateway"] + sorted(
    set(MAPPED_FOLDERS + ["runtime"]) - {"kernels", "protos", "gateway", "splitspec"}
)

# Outer-environment entries that must not be visible inside the test venvs.
_OUTER_EXCLUDE_PREFIXES = ("splitspec", "__editable__", "__editable___splitspec")
_OUTER_EXCLUDE_SUFFIXES = (".pth", ".egg-link")

# setuptools that can build this pyproject offline (PEP 639 `license = "Apache-2.0"` needs >= 77).
_MIN_SETUPTOOLS = (77,)

_CHECK_SCRIPT = r"""
import importlib, importlib.metadata, importlib.util, json, os, site, sys
from pathlib import Path

params = json.loads(sys.argv[1])
report = {"sys_path": list(sys.path), "meta_path": [repr(f) for f in sys.meta_path],
          "top_level": {}, "packages": {}, "pth": {}, "path_entries_with_name": {}}

for name in params["top_level"]:
    entry = {"spec": None, "locations": [], "import_error": None}
    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:  # a broken foreign package: still not ours
        entry["import_error"] = f"find_spec: {type(exc).__name__}: {exc}"
        spec = None
    if spec is not None:
        entry["spec"] = repr(spec)
        entry["locations"] = [p for p in [spec.origin, *(spec.submodule_search_locations or [])]
                              if p and os.path.isabs(p)]
    else:
        try:
            importlib.import_module(name)
            entry["import_error"] = "imported although find_spec returned None"
        except ModuleNotFoundError as exc:
            entry["import_error"] = f"ModuleNotFoundError: {exc}"
    report["top_level"][name] = entry
    # Every sys.path entry that would offer this name (not just the first), to catch shadowed leaks.
    hits = []
    for p in sys.path:
        d = Path(p or os.getcwd())
        for cand in (d / name / "__init__.py", d / name, d / f"{name}.py"):
            if cand.exists():
                hits.append(str(cand))
                break
    report["path_entries_with_name"][name] = hits

for pkg in params["packages"]:
    try:
        mod = importlib.import_module(pkg)
    except Exception as exc:
        report["packages"][pkg] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    report["packages"][pkg] = {"file": getattr(mod, "__file__", None),
                               "path": list(getattr(mod, "__path__", []))}

for d in site.getsitepackages():
    for f in sorted(Path(d).glob("*.pth")):
        report["pth"][str(f)] = f.read_text(errors="replace")

report["dist_files"] = [str(f.locate()) for f in (importlib.metadata.distribution("splitspec").files or [])
                        if f.name == "METADATA"]
print(json.dumps(report))
"""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _outer_site_dirs() -> list[Path]:
    """The running environment's site-packages folders, in sys.path order, deduplicated."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    seen, out = set(), []
    for d in dirs:
        p = Path(d)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


def _is_splitspec_entry(name: str) -> bool:
    low = name.lower()
    return low.startswith(_OUTER_EXCLUDE_PREFIXES) or low.endswith(_OUTER_EXCLUDE_SUFFIXES)


@pytest.fixture(scope="module")
def outer_farm(tmp_path_factory) -> list[Path]:
    """Symlink views of the outer site-packages without anything of splitspec's and without .pth files
    (a .pth line that names a folder adds it to sys.path, but .pth files inside it are not run)."""
    root = tmp_path_factory.mktemp("outer-site")
    farms = []
    for i, d in enumerate(_outer_site_dirs()):
        farm = root / str(i)
        farm.mkdir()
        for entry in d.iterdir():
            if not _is_splitspec_entry(entry.name):
                (farm / entry.name).symlink_to(entry)
        farms.append(farm)
    return farms


def _copy_project(dest: Path) -> Path:
    """pyproject.toml, README/LICENSE files and the package folders it maps, nothing else."""
    dest.mkdir(parents=True)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    for f in REPO.iterdir():
        if f.is_file() and f.name.upper().startswith(("README", "LICENSE", "LICENCE", "NOTICE", "COPYING")):
            shutil.copy2(f, dest / f.name)
    folders = {p.split("/")[0] for p in PACKAGE_DIR.values()} | {pkg.split(".")[0] for pkg in PACKAGES}
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".pytest_cache")
    for folder in sorted(folders):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, dest / folder, ignore=ignore, symlinks=True)
    return dest


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV",
                "PIP_USER", "PIP_TARGET", "PIP_PREFIX", "PIP_REQUIRE_VIRTUALENV", "PIP_NO_BUILD_ISOLATION"):
        env.pop(var, None)
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = lifeline.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr\n{proc.stderr}")
    return proc


def _make_venv(path: Path, farms: list[Path], outside: Path) -> tuple[Path, Path]:
    """A venv with no pip of its own; the outer environment's packages come from `farms`."""
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    _run([base_python, "-m", "venv", "--without-pip", str(path)], cwd=outside)
    python = path / "bin" / "python"
    purelib = Path(_run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=outside).stdout.strip())
    (purelib / "_splitspec_test_outer_site.pth").write_text("".join(f"{f}\n" for f in farms))
    return python, purelib


def _expected_source_dir(pkg: str) -> str:
    """Folder (relative to the project root) that holds `pkg`, per package-dir."""
    for n in range(pkg.count(".") + 1, 0, -1):
        head = ".".join(pkg.split(".")[:n])
        if head in PACKAGE_DIR:
            rest = pkg.split(".")[n:]
            return "/".join([PACKAGE_DIR[head].rstrip("/"), *rest]) if PACKAGE_DIR[head] else "/".join(rest)
    return pkg.replace(".", "/")


def _within(path: str | os.PathLike, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("mode", ["regular", "editable"])
def test_installed_layout_has_one_import_root(mode, tmp_path, outer_farm):
    # Sanity of the premise: pyproject really maps the card's folders (§7).
    for name in ("gateway", "kernels", "protos"):
        assert PACKAGE_DIR.get(f"splitspec.{name}") == name, f"pyproject package-dir no longer maps {name}/"

    outside = tmp_path / "elsewhere"  # cwd for every command: not the repo, not the copy
    outside.mkdir()
    project = _copy_project(tmp_path / "project")
    python, purelib = _make_venv(tmp_path / "venv", outer_farm, outside)

    pip = [str(python), "-I", "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-q"]
    try:
        st_version = _version_tuple(metadata.version("setuptools"))
    except metadata.PackageNotFoundError:
        st_version = ()
    if st_version >= _MIN_SETUPTOOLS:
        pip += ["--no-index", "--no-build-isolation"]  # offline: the outer setuptools builds it
    # else: pip fetches setuptools into an isolated build env (needs the package index)
    pip += ["-e", str(project)] if mode == "editable" else [str(project)]
    _run(pip, cwd=outside)

    install_root = project if mode == "editable" else purelib
    params = {"top_level": TOP_LEVEL_NAMES, "packages": PACKAGES}
    proc = _run([str(python), "-I", "-B", "-c", _CHECK_SCRIPT, json.dumps(params)], cwd=outside)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    context = (f"\nmode={mode}\nsys.path={json.dumps(report['sys_path'], indent=1)}\n"
               f"meta_path={report['meta_path']}\n.pth files={json.dumps(report['pth'], indent=1)}")

    # The distribution that answers is the one we just installed.
    assert report["dist_files"] and all(_within(f, purelib) for f in report["dist_files"]), (
        f"splitspec metadata not from the test venv: {report['dist_files']}{context}"
    )

    # 1. Top-level names never resolve to our code (repo, its copy, or anything we installed).
    ours = [REPO, project, purelib]
    for name in TOP_LEVEL_NAMES:
        entry = report["top_level"][name]
        leaked = [loc for loc in entry["locations"] if any(_within(loc, root) for root in ours)]
        assert not leaked, f"`import {name}` resolves to our code: {entry}{context}"
        if entry["spec"] is None:
            assert (entry["import_error"] or "").startswith("ModuleNotFoundError"), f"{name}: {entry}{context}"
        shadowed = [h for h in report["path_entries_with_name"][name] if any(_within(h, r) for r in ours)]
        assert not shadowed, f"a sys.path entry offers top-level `{name}` from our code: {shadowed}{context}"

    # No .pth line puts the project root on sys.path (the classic `.pth` editable install, which
    # setuptools uses for `editable_mode=compat` or a `package-dir = {"" = "."}` layout). A folder
    # inside the project is fine as long as it offers none of the names (checked above), e.g. the
    # link tree of `editable_mode=strict`.
    for pth, text in report["pth"].items():
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ")) and os.path.isabs(line):
                assert Path(line).resolve() not in (project.resolve(), REPO.resolve()), (
                    f"{pth} puts the project root {line} on sys.path{context}"
                )

    # 2. splitspec and every mapped package import from the installed location.
    for pkg in PACKAGES:
        info = report["packages"][pkg]
        assert "error" not in info, f"`import {pkg}` failed: {info['error']}{context}"
        expected = (install_root / _expected_source_dir(pkg)) if mode == "editable" else (
            purelib / pkg.replace(".", "/"))
        if info["file"]:  # None for a folder without __init__.py (a namespace package)
            assert Path(info["file"]).resolve().parent == expected.resolve(), (
                f"{pkg} imported from {info['file']}, expected {expected}{context}"
            )
        assert info["path"] and all(Path(p).resolve() == expected.resolve() for p in info["path"]), (
            f"{pkg}.__path__ = {info['path']}, expected [{expected}]{context}"
        )


SOURCE_TREE_CHECK = """
import importlib, json, sys
sys.path.append(sys.argv[1])  # the environment's packages, without its .pth files (no editable finder)
print(json.dumps({pkg: importlib.import_module(pkg).__path__[0] for pkg in json.loads(sys.argv[2])}))
"""


def test_a_source_tree_on_the_path_imports_every_mapped_package():
    """No install at all (a GPU image), `python -m splitspec ...` run in the repository's root as `splitspec up`
    starts its services: the root's splitspec/ comes first on sys.path, and its mapped sub-packages
    (splitspec.drafter_svc from drafter_svc/, ...) still import, from the repository's folders."""
    purelib = sysconfig.get_paths()["purelib"]
    result = lifeline.run([sys.executable, "-S", "-c", SOURCE_TREE_CHECK, purelib, json.dumps(PACKAGES)], cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    paths = json.loads(result.stdout)
    for pkg in PACKAGES:
        assert Path(paths[pkg]).resolve() == (REPO / _expected_source_dir(pkg)).resolve(), (pkg, paths[pkg])
    helped = lifeline.run([sys.executable, "-S", "-m", "splitspec", "drafter", "--help"], cwd=REPO,
                          env={**_clean_env(), "PYTHONPATH": purelib}, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--verifier-drafter-addr" in helped.stdout, helped.stderr
