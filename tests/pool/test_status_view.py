"""`eagle-ray status --watch`: the pool's status as a compact table."""

import ast
import json
import re
from pathlib import Path

from eagle_ray.pool.status_view import format_status


def test_the_status_table_shows_supply_demand_and_each_replica():
    replica = {"index": 0, "state": "ready", "node_id": "abcdef1234", "tokens_per_s": 1234.4,
               "outstanding_tokens": 512, "served_micro_batches": 40, "on_node_share": 0.975,
               "errors": 1, "restarts": 0}
    status = {"replicas": {"p-replica-0": replica,
                           "p-replica-1": {**replica, "index": 1, "state": "starting",
                                           "node_id": None, "on_node_share": None}},
              "ready_replicas": 1, "leases": 40, "demand_tokens": 900,
              "autoscaling": {"min_replicas": 1, "max_replicas": 4, "desired": 2, "starting": 1,
                              "removing": 0, "scale_ups": 1, "scale_downs": 0,
                              "last_decision": {"replicas_before": 1, "replicas_after": 2,
                                                "reason": "demand high"}}}
    lines = format_status("p", status).splitlines()
    assert lines[0] == "pool p: 1/2 replicas ready, demand 900 tokens, 40 leases"
    assert "desired 2, starting 1" in lines[1] and "1 -> 2 (demand high)" in lines[2]
    assert lines[3].split() == ["replica", "state", "node", "tok/s", "outstanding", "served",
                                "on-node", "errors", "restarts"]
    assert lines[4].split() == ["0", "ready", "abcdef12", "1234", "512", "40", "98%", "1", "0"]
    assert lines[5].split()[:3] == ["1", "starting", "-"] and lines[5].split()[6] == "-"


ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_count", "_sum")}
RAY_LABELS = {"le"}  # histogram buckets; Ray adds instance labels too, none of them queried


def defined_series(telemetry_source: str) -> dict[str, tuple[str, set[str]]]:
    """`{name: (metric type, tag keys)}` of every `metrics.<Type>(...)` in telemetry.py."""
    module = ast.parse(telemetry_source)
    constants = {t.id: ast.literal_eval(node.value) for node in module.body
                 if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name) and isinstance(node.value, ast.Tuple)}
    series = {}
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in SUFFIXES:
            keys = next(k.value for k in node.keywords if k.arg == "tag_keys")
            tags = constants[keys.id] if isinstance(keys, ast.Name) else ast.literal_eval(keys)
            series[node.args[0].value] = (node.func.attr, set(tags))
    return series


def dashboard_problems(dashboard: str, series: dict[str, tuple[str, set[str]]]) -> list[str]:
    """What in the dashboard's queries names no reported series: an unknown name, a suffix the
    metric's type does not export, a label it does not carry; and series without a panel."""
    problems, used = [], set()
    queries = re.findall(r'"(?:expr|query)": "((?:[^"\\]|\\.)*)"', dashboard)
    for query in queries:
        for full, labels in re.findall(r"ray_(eagle_ray_[a-z_]+)(\{[^}]*\})?", query):
            match = next(((name, suffix) for name, (kind, _) in series.items()
                          for suffix in SUFFIXES[kind] if full == name + suffix), None)
            if match is None:
                problems.append(f"{full}: no such series (or a suffix its type lacks)")
                continue
            used.add(match[0])
            tags = series[match[0]][1] | RAY_LABELS
            problems += [f"{full}: no label {label}"
                         for label in re.findall(r"([a-z_]+)\s*=~?", labels)
                         if label not in tags]
        for group in re.findall(r"by \(([^)]*)\)", query):
            problems += [f"grouped by {label}, which no series carries"
                         for label in (g.strip() for g in group.split(","))
                         if label not in set().union(*(t for _, t in series.values()),
                                                     RAY_LABELS)]
    problems += [f"{name}: no panel" for name in sorted(set(series) - used)]
    return problems


def test_the_grafana_dashboard_queries_only_series_and_labels_eagle_ray_reports():
    series = defined_series((ROOT / "eagle_ray" / "pool" / "telemetry.py").read_text())
    assert len(series) >= 10, series
    dashboard = (ROOT / "examples" / "grafana-dashboard.json").read_text()
    json.loads(dashboard)
    assert dashboard_problems(dashboard, series) == []


def test_the_dashboard_check_catches_a_wrong_name_suffix_or_label():
    """The control: each kind of mistake in a query is reported."""
    series = defined_series((ROOT / "eagle_ray" / "pool" / "telemetry.py").read_text())
    dashboard = (ROOT / "examples" / "grafana-dashboard.json").read_text()
    for wrong, words in (
            ("ray_eagle_ray_pool_ready_replicas{", "ray_eagle_ray_pool_ready_replica{"),
            ("ray_eagle_ray_replica_errors_total{", "ray_eagle_ray_replica_errors{"),
            ('ray_eagle_ray_pool_demand_tokens{pool=~', 'ray_eagle_ray_pool_demand_tokens{run=~')):
        assert wrong in dashboard
        assert dashboard_problems(dashboard.replace(wrong, words, 1), series), words
