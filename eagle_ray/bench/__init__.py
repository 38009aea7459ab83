"""Benchmarks: each prints one JSON object per line (`bench`, `metric`, `value`, `unit`, and for
a comparison `baseline` and `ratio`), measured side by side in one run."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

NAMESPACE = "eagle_ray_bench"  # every benchmark's pool lives here
SYNTHETIC = "eagle_ray.testing:fixed_latency_target"  # the fixed-latency backend


def emit(bench: str, metric: str, value: float, unit: str, **extra) -> dict:
    """Write one result line to stdout and return it."""
    record = {"bench": bench, "metric": metric, "value": value, "unit": unit, **extra}
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
    return record


def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of `repeats` runs after one warm-up: the least noisy estimate on a shared box."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
