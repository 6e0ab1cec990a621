"""The provisioned Grafana dashboards: the committed JSON is what scripts/gen_dashboards.py writes; every
panel uses the provisioned datasource, has a unique id and a query; and under load on `splitspec up`
(EAGLE drafters in their own processes) a real Prometheus running the configuration the launcher writes
(the gateway and the verifier by address, the drafters through the verifier's /sd/drafters) has every
target up and returns data for every query of every panel."""

from __future__ import annotations

import importlib.util
import json
import math
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import yaml
from test_launcher import Up

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "deploy" / "compose" / "grafana"


def generator():
    spec = importlib.util.spec_from_file_location("gen_dashboards", REPO / "scripts" / "gen_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def test_dashboards_are_generated_and_valid():
    assert {name: json.dumps(d, indent=2) + "\n" for name, d in dashboards().items()} == generator().render()
    # compose's Prometheus configuration is the launcher's, for the compose topology
    assert (REPO / "deploy" / "compose" / "prometheus.yml").read_text() == generator().render_prometheus()
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "splitspec.yml").read_text())["providers"][0]
    compose = yaml.safe_load((REPO / "deploy" / "compose" / "compose.yaml").read_text())
    mounts = {v["target"]: v["source"] for v in compose["services"]["grafana"]["volumes"]}
    assert mounts[provider["options"]["path"]] == "./grafana/dashboards"
    titles = set()
    for name, board in dashboards().items():
        assert board["uid"] == name.removesuffix(".json") and board["title"] not in titles
        titles.add(board["title"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["targets"] and all(t["expr"].strip() and t["datasource"]["uid"] == datasource["uid"]
                                            for t in panel["targets"]), panel["title"]
    titles_all = {p["title"] for board in dashboards().values() for p in board["panels"]}
    # every panel of vLLM's speculative-decoding dashboard has a counterpart (REFERENCES §10)
    for needed in ("Draft acceptance rate", "Mean acceptance length", "Accepted tokens/s", "Draft tokens/s", "Drafts/s",
                   "Share of output from drafts", "Acceptance rate by model", "Acceptance rate by draft position",
                   "Draft tokens/s: proposed, accepted, rejected", "Inter-token latency (p50, p95, p99)"):
        assert needed in titles_all, needed


def test_every_panel_query_returns_data_under_load(tmp_path):
    from test_verifier_service import Prometheus

    config_file = tmp_path / "prometheus-up.yml"
    up = Up("--drafters", "2", "--speculative-algorithm", "EAGLE", "--log-level", "warning",
            "--prometheus-config", str(config_file))
    server, workers = None, []
    stop = threading.Event()
    try:
        up.wait_for_line(r"serving splitspec-demo at ")
        config = yaml.safe_load(config_file.read_text())
        assert {job["job_name"] for job in config["scrape_configs"]} == {"splitspec-gateway", "splitspec-verifier",
                                                                         "splitspec-drafters"}
        config["global"] = {"scrape_interval": "500ms", "evaluation_interval": "500ms"}  # the test's pace
        config["scrape_configs"][-1]["http_sd_configs"][0]["refresh_interval"] = "1s"
        server = Prometheus(tmp_path, config_text=yaml.safe_dump(config))

        def load():
            prompts = [f"def handler_{i}(request):\n" for i in range(6)]
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    for p in prompts:
                        http.post(up.url + "/v1/completions", json={"model": "splitspec-demo", "prompt": p,
                                                                    "max_tokens": 24, "temperature": 0})
                    http.post(up.url + "/v1/chat/completions", json={"model": "splitspec-demo", "stream": True,
                              "messages": [{"role": "user", "content": "x"}], "max_tokens": 8})

        workers = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.time() + 300  # scrapes every 0.5 s; rates need two samples with traffic between them (a generous
        # bound: a CPU shared with other tests delays the first samples, and the loop ends as soon as every query answers)
        while True:
            targets = server.targets()
            empty = [f"target {t['scrapeUrl']} ({t['labels']['job']}): {t['health']} {t['lastError']}"
                     for t in targets if t["health"] != "up"]
            jobs = sorted(t["labels"]["job"] for t in targets)
            if jobs != ["splitspec-drafters", "splitspec-drafters", "splitspec-gateway", "splitspec-verifier"]:
                empty.append(f"targets: {jobs}")
            for name, board in dashboards().items():
                for panel in board["panels"]:
                    for target in panel["targets"]:
                        values = query(server.port, target["expr"])
                        if not any(math.isfinite(v) for v in values):
                            empty.append(f"{name} / {panel['title']}: {target['expr']} -> {values}")
            if not empty or time.time() > deadline:
                break
            time.sleep(2)
        assert not empty, "\n".join(empty + ["the deployment's log, last lines:", *up.lines[-60:]])
    finally:
        stop.set()
        for w in workers:  # each finishes its round while the services still run
            w.join(timeout=120)
        if server is not None:
            server.close()
        assert up.stop() == 0


def query(port: int, expr: str) -> list[float]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", (expr, body)
    return [float(r["value"][1]) for r in body["data"]["result"]]
