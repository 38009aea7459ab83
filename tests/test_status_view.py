"""`eagle-ray status --watch`: the pool's status as a compact table."""

from eagle_ray.pool.status_view import format_status


def test_the_status_table_shows_supply_demand_and_each_replica():
    replica = {"state": "ready", "node_id": "abcdef1234", "tokens_per_s": 1234.4,
               "outstanding_tokens": 512, "served_micro_batches": 40, "on_node_share": 0.975,
               "errors": 1, "restarts": 0}
    status = {"replicas": {"p-replica-0": replica,
                           "p-replica-1": {**replica, "state": "starting", "node_id": None,
                                           "on_node_share": None}},
              "ready_replicas": 1, "leases": 40, "demand_tokens": 900,
              "autoscaling": {"min_replicas": 1, "max_replicas": 4, "desired": 2, "starting": 1,
                              "removing": 0, "scale_ups": 1, "scale_downs": 0,
                              "last_decision": {"from": 1, "to": 2, "reason": "demand high"}}}
    lines = format_status("p", status).splitlines()
    assert lines[0] == "pool p: 1/2 replicas ready, demand 900 tokens, 40 leases"
    assert "desired 2, starting 1" in lines[1] and "1 -> 2 (demand high)" in lines[2]
    assert lines[3].split() == ["replica", "state", "node", "tok/s", "outstanding", "served",
                                "on-node", "errors", "restarts"]
    assert lines[4].split() == ["0", "ready", "abcdef12", "1234", "512", "40", "98%", "1", "0"]
    assert lines[5].split()[:3] == ["1", "starting", "-"] and lines[5].split()[6] == "-"


def test_the_grafana_dashboard_plots_only_series_eagle_ray_reports():
    """Every `ray_eagle_ray_*` series the dashboard queries is one `telemetry.py` defines."""
    import ast
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = (root / "eagle_ray" / "pool" / "telemetry.py").read_text()
    defined = {node.value for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and re.fullmatch(r"eagle_ray_[a-z_]+", node.value)}
    dashboard = (root / "examples" / "grafana-dashboard.json").read_text()
    json.loads(dashboard)
    queried = set(re.findall(r"ray_(eagle_ray_[a-z_]+?)(?:_total|_bucket)?\b", dashboard))
    assert queried and queried <= defined, queried - defined
    assert defined <= queried, f"series without a panel: {defined - queried}"
