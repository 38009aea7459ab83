"""Benchmarks: each prints one JSON object per line (`bench`, `metric`, `value`, `unit`, and for
a comparison `baseline` and `ratio`), measured side by side in one run."""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

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


# `eagle-ray bench NAME`: (module, function, what it is given: the tiny target's path, options).
BENCHMARKS: dict[str, tuple[str, str, Callable[[str, Any], dict[str, Any]]]] = {
    "encodings": ("encodings", "run", lambda path, opts: {}),
    "backends": ("backends", "run", lambda path, opts: {"model_path": path}),
    "handoff": ("handoff", "run", lambda path, opts: {}),
    "engine-start": ("backends", "run_engine_start", lambda path, opts: {"model_path": path}),
    "pool": ("pool", "run_overhead", lambda path, opts: {
        "model_path": path, "shapes": [(8, 128), (16, 256), (8, 480)]}),
    "router": ("pool", "run_router", lambda path, opts: {}),
    "scaling": ("pool", "run_scaling", lambda path, opts: {}),
    "transport": ("transport", "run", lambda path, opts: {}),
    "locality": ("locality", "run", lambda path, opts: {}),
    "autoscale": ("autoscale", "run", lambda path, opts: {}),
    "train": ("train", "run", lambda path, opts: {"model_path": path}),
    "cache": ("cache", "run", lambda path, opts: {"model_path": path}),
    "ingest": ("ingest", "run", lambda path, opts: {
        "model_path": path, "sizes": tuple(opts.conversations)}),
    "soak": ("soak", "run", lambda path, opts: {"minutes": opts.minutes}),
}


def run(which: str, model_path: str, options: Any) -> None:
    """Run benchmark `which` (a key of `BENCHMARKS`) on the tiny target at `model_path`."""
    module, function, arguments = BENCHMARKS[which]
    getattr(importlib.import_module(f"eagle_ray.bench.{module}"), function)(
        **arguments(model_path, options))
