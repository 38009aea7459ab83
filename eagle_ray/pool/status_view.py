"""A pool's status as a compact terminal table (`eagle-ray status --watch`): one line for the
pool (demand vs supply, autoscaling), one per replica."""

from __future__ import annotations

from typing import Any

COLUMNS = ("replica", "state", "node", "tok/s", "outstanding", "served", "on-node", "errors",
           "restarts")


def format_status(name: str, status: dict[str, Any]) -> str:
    """The table for `status` as `TargetPool.status()` returns it."""
    replicas = status["replicas"]
    head = (f"pool {name}: {status['ready_replicas']}/{len(replicas)} replicas ready, "
            f"demand {status.get('demand_tokens', 0)} tokens, {status['leases']} leases")
    scaling = status.get("autoscaling")
    if scaling:
        head += (f"\nautoscaling {scaling['min_replicas']}..{scaling['max_replicas']}: desired "
                 f"{scaling['desired']}, starting {scaling['starting']}, removing "
                 f"{scaling['removing']}; {scaling['scale_ups']} up, {scaling['scale_downs']} "
                 f"down")
        last = scaling.get("last_decision")
        if last:
            head += (f"\n  last: {last['replicas_before']} -> {last['replicas_after']} "
                     f"({last['reason']})")
    rows = [COLUMNS] + [(
        str(r["index"]), r["state"], (r["node_id"] or "-")[:8],
        f"{r['tokens_per_s']:.0f}", str(r["outstanding_tokens"]), str(r["served_micro_batches"]),
        "-" if r.get("on_node_share") is None else f"{r['on_node_share']:.0%}",
        str(r["errors"]), str(r["restarts"])) for r in replicas.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    return head + "\n" + "\n".join(lines)
