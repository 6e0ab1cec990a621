"""Writes the provisioned Grafana dashboards (deploy/compose/grafana/dashboards/*.json) from the panel
lists below, and compose's Prometheus configuration (deploy/compose/prometheus.yml, the launcher's
prometheus_config): `python scripts/gen_dashboards.py`. tests/test_dashboards.py checks the committed
files equal this output, validates them, and runs every panel's PromQL against a real Prometheus
under load.

Panels follow vLLM's speculative-decoding dashboard (acceptance rate and length, per-position
acceptance, drafts/s, draft tokens proposed/accepted/rejected, share of output from drafts,
inter-token latency) and its general one (latencies, throughput, requests, queue, KV cache), plus the
split's own (drafter health, round trip, drafting time, bytes, fallbacks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "splitspec-prometheus"}
COMPOSE = Path(__file__).resolve().parent.parent / "deploy" / "compose"
OUT = COMPOSE / "grafana" / "dashboards"
W = "[1m]"


def q(metric: str, quantiles=(0.5, 0.9, 0.99), by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"p{{q}}{' {{' + by + '}}' if by else ''}"
    return [(f"histogram_quantile({x}, sum by ({group}) (rate({metric}_bucket{W})))",
             legend.replace("{q}", str(int(x * 100)))) for x in quantiles]


def rate(metric: str, by: str = "") -> str:
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{W}))"


ACCEPTED, DRAFTS, DRAFT_TOKENS = ("splitspec:spec_decode_num_accepted_tokens_total", "splitspec:spec_decode_num_drafts_total",
                                  "splitspec:spec_decode_num_draft_tokens_total")

DASHBOARDS = {
    "splitspec-overview": ("splitspec: Overview", [
        ("Time to first token (s)", "timeseries", "s", q("splitspec:time_to_first_token_seconds")),
        ("Inter-token latency (s)", "timeseries", "s", q("splitspec:inter_token_latency_seconds")),
        ("End-to-end latency (s)", "timeseries", "s", q("splitspec:e2e_request_latency_seconds")),
        ("Output tokens/s", "timeseries", "short", [(rate("splitspec:gateway_completion_tokens_total"), "tokens/s")]),
        ("Prompt tokens/s", "timeseries", "short", [(rate("splitspec:gateway_prompt_tokens_total"), "tokens/s")]),
        ("HTTP requests/s by status", "timeseries", "reqps",
         [(rate("splitspec:gateway_http_requests_total", "status_code"), "{{status_code}}")]),
        ("Finished choices/s by reason", "timeseries", "short",
         [(rate("splitspec:gateway_finished_choices_total", "finish_reason"), "{{finish_reason}}")]),
        ("Queue", "timeseries", "short", [("sum(splitspec:num_requests_running)", "running"),
                                          ("sum(splitspec:num_requests_waiting)", "waiting"),
                                          ("sum(splitspec:gateway_requests_in_flight)", "in flight (gateway)")]),
        ("KV cache usage", "gauge", "percentunit",
         [("sum(splitspec:kv_pages_used) / (sum(splitspec:kv_pages_used) + sum(splitspec:kv_pages_free))", "used")]),
        ("Prefix-cache hit rate", "timeseries", "percentunit",
         [(f"{rate('splitspec:prefix_cache_hit_tokens_total')} / {rate('splitspec:prompt_tokens_total')}", "hit rate")]),
        ("Preemptions/s", "timeseries", "short", [(rate("splitspec:num_preemptions_total"), "preemptions/s")]),
        ("Verifier step phases (mean s)", "timeseries", "s",
         [(f"{rate('splitspec:step_phase_seconds_sum', 'phase')} / {rate('splitspec:step_phase_seconds_count', 'phase')}",
           "{{phase}}")]),
        ("Verifier engine loop per step (mean s)", "timeseries", "s",
         [(f"{rate('splitspec:engine_loop_seconds_sum', 'part')} / {rate('splitspec:engine_loop_seconds_count', 'part')}",
           "{{part}}")]),
    ]),
    "splitspec-speculative": ("splitspec: Speculative decoding", [
        ("Draft acceptance rate", "stat", "percentunit", [(f"{rate(ACCEPTED)} / {rate(DRAFT_TOKENS)}", "acceptance rate")]),
        ("Mean acceptance length", "stat", "short", [(f"1 + {rate(ACCEPTED)} / {rate(DRAFTS)}", "tokens per step")]),
        ("Accepted tokens/s", "stat", "short", [(rate(ACCEPTED), "accepted/s")]),
        ("Draft tokens/s", "stat", "short", [(rate(DRAFT_TOKENS), "proposed/s")]),
        ("Drafts/s", "stat", "short", [(rate(DRAFTS), "drafts/s")]),
        ("Share of output from drafts", "stat", "percentunit",
         [(f"{rate(ACCEPTED)} / {rate('splitspec:generation_tokens_total')}", "from drafts")]),
        ("Acceptance rate by model", "timeseries", "percentunit",
         [(f"{rate(ACCEPTED, 'model_name')} / {rate(DRAFT_TOKENS, 'model_name')}", "{{model_name}}")]),
        ("Mean acceptance length by model", "timeseries", "short",
         [(f"1 + {rate(ACCEPTED, 'model_name')} / {rate(DRAFTS, 'model_name')}", "{{model_name}}")]),
        ("Acceptance rate by draft position", "timeseries", "percentunit",
         [(f"{rate('splitspec:spec_decode_num_accepted_tokens_per_pos_total', 'position')} / scalar({rate(DRAFTS)})",
           "position {{position}}")]),
        ("Draft tokens/s: proposed, accepted, rejected", "timeseries", "short",
         [(rate(DRAFT_TOKENS), "proposed"), (rate(ACCEPTED), "accepted"), (f"{rate(DRAFT_TOKENS)} - {rate(ACCEPTED)}", "rejected")]),
        ("Tokens per verify step (p50, p90)", "timeseries", "short", q("splitspec:spec_accept_length", (0.5, 0.9))),
        ("Inter-token latency (p50, p95, p99)", "timeseries", "s", q("splitspec:inter_token_latency_seconds", (0.5, 0.95, 0.99))),
        ("Fallbacks to plain decoding/s", "timeseries", "short", [(rate("splitspec:spec_decode_fallbacks_total"), "fallbacks/s")]),
        ("Tree budget per step (1 = no drafts; --speculative-adaptive)", "timeseries", "short",
         [("max(splitspec:spec_adaptive_num_draft_tokens)", "tree nodes"), ("max(splitspec:spec_adaptive_num_steps)", "depth")]),
        ("Adaptive speculation: switches, probes and tries/s", "timeseries", "short",
         [(f"{rate('splitspec:spec_adaptive_switches_total')} or vector(0)", "budget switches/s"),
          (f"{rate('splitspec:spec_adaptive_probes_total')} or vector(0)", "probes/s"),
          (f"{rate('splitspec:spec_adaptive_tries_total')} or vector(0)", "tries/s")]),
    ]),
    "splitspec-drafters": ("splitspec: Drafters", [
        ("Drafters alive", "stat", "short", [("sum(splitspec:drafters_alive)", "alive")]),
        ("Heartbeats/s by drafter", "timeseries", "short", [(rate("splitspec:drafter_heartbeats_total", "drafter"), "{{drafter}}")]),
        ("Requests pinned by drafter", "timeseries", "short", [("sum by (drafter) (splitspec:drafter_requests_pinned)", "{{drafter}}")]),
        ("Step-channel round trip (s)", "timeseries", "s", q("splitspec:drafter_round_trip_seconds", (0.5, 0.99), by="drafter")),
        ("Drafting time per step (s)", "timeseries", "s", q("splitspec:drafter_step_seconds", (0.5, 0.99), by="drafter")),
        ("Step-channel bytes/s", "timeseries", "Bps",
         [(rate("splitspec:drafter_bytes_total", "drafter, direction"), "{{drafter}} {{direction}}")]),
        ("Hidden-state bytes/s", "timeseries", "Bps",
         [(rate("splitspec:drafter_hidden_state_bytes_total", "drafter"), "{{drafter}}")]),
        ("Acceptance rate by drafter", "timeseries", "percentunit",
         [(f"{rate('splitspec:drafter_accepted_tokens_total', 'drafter')} / "
           f"{rate('splitspec:drafter_draft_tokens_total', 'drafter')}", "{{drafter}}")]),
        ("Drafts dropped/s by reason", "timeseries", "short",
         [(f"{rate('splitspec:drafter_drafts_dropped_total', 'reason')} or vector(0)", "{{reason}}")]),
        ("Re-pins and registrations", "timeseries", "short",
         [("sum(splitspec:drafter_repins_total)", "re-pinned requests"),
          ("sum by (outcome) (splitspec:drafter_registrations_total)", "registrations {{outcome}}")]),
        # the drafters' own endpoints, found through the verifier's /sd/drafters
        ("Drafter endpoints up", "stat", "short", [('sum(up{job="splitspec-drafters"})', "up")]),
        ("Requests held by drafter (its own count)", "timeseries", "short",
         [("sum by (drafter) (splitspec:drafter_held_requests)", "{{drafter}}")]),
        ("Drafter compute per step (s)", "timeseries", "s", q("splitspec:drafter_compute_seconds", (0.5, 0.99), by="drafter")),
        ("Drafter batch size (mean requests per step)", "timeseries", "short",
         [(f"{rate('splitspec:drafter_step_batch_size_sum', 'drafter')} / {rate('splitspec:drafter_step_batch_size_count', 'drafter')}",
           "{{drafter}}")]),
        ("Draft tokens proposed/s by drafter", "timeseries", "short",
         [(rate("splitspec:drafter_proposed_tokens_total", "drafter"), "{{drafter}}")]),
        ("Draft-model KV cache usage", "timeseries", "percentunit",
         [("max by (drafter) (splitspec:drafter_kv_cache_usage)", "{{drafter}}")]),
        ("Drafter CPU (cores)", "timeseries", "short",
         [('rate(process_cpu_seconds_total{job="splitspec-drafters"}[1m]) * on (instance) group_left (drafter) '
           "splitspec:drafter_info", "{{drafter}}")]),
        ("Drafter memory (RSS)", "timeseries", "bytes",
         [('process_resident_memory_bytes{job="splitspec-drafters"} * on (instance) group_left (drafter) '
           "splitspec:drafter_info", "{{drafter}}")]),
        ("Drafter session resets, dropped messages and superseded asks", "timeseries", "short",
         [("sum by (reason) (splitspec:drafter_session_resets_total) or vector(0)", "resets {{reason}}"),
          ("sum by (reason) (splitspec:drafter_dropped_messages_total)", "dropped {{reason}}"),
          ("sum(splitspec:drafter_superseded_asks_total)", "superseded asks (fell behind)")]),
    ]),
}


def dashboard(uid: str, title: str, panels: list) -> dict:
    out = []
    for i, (name, kind, unit, queries) in enumerate(panels):
        width = 6 if kind in ("stat", "gauge") else 12
        per_row = 24 // width
        out.append({
            "id": i + 1, "type": kind, "title": name, "datasource": DATASOURCE,
            "gridPos": {"h": 4 if width == 6 else 8, "w": width, "x": (i % per_row) * width, "y": (i // per_row) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(queries)],
        })
    return {"uid": uid, "title": title, "tags": ["splitspec"], "timezone": "browser", "schemaVersion": 39,
            "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "editable": False, "panels": out}


def render() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard(uid, title, panels), indent=2) + "\n"
            for uid, (title, panels) in DASHBOARDS.items()}


def render_prometheus() -> str:
    from splitspec.launcher import prometheus_config

    return prometheus_config("compose", 30000)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}", file=sys.stderr)
    (COMPOSE / "prometheus.yml").write_text(render_prometheus())
    print(f"wrote {COMPOSE / 'prometheus.yml'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
