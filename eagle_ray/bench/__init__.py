"""Benchmarks: each prints one JSON object per line (`bench`, `metric`, `value`, `unit`, and for
a comparison `baseline` and `ratio`), measured side by side in one run.

Stdout carries those lines and nothing else (`results_only_on_stdout`): Ray's driver prints its
raylet warnings there and vLLM's in-process engine logs there, so while a benchmark runs file
descriptor 1 points at stderr and the result lines go to a copy of the original stdout.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

NAMESPACE = "eagle_ray_bench"  # every benchmark's pool lives here
SYNTHETIC = "eagle_ray.testing:fixed_latency_target"  # the fixed-latency backend

_results: TextIO | None = None  # the original stdout while `results_only_on_stdout` holds
_saved: list[dict] | None = None  # every line emitted while `run` saves them (`--save`)


def emit(bench: str, metric: str, value: float, unit: str, **extra) -> dict:
    """Write one result line to stdout and return it."""
    record = {"bench": bench, "metric": metric, "value": value, "unit": unit, **extra}
    out = _results or sys.stdout
    out.write(json.dumps(record) + "\n")
    out.flush()
    if _saved is not None:
        _saved.append(record)
    return record


@contextlib.contextmanager
def results_only_on_stdout() -> Iterator[None]:
    """Point file descriptor 1 at stderr (this process's prints, Ray's and vLLM's, and those of
    processes started meanwhile) and keep the original stdout for `emit` alone."""
    global _results
    sys.stdout.flush()
    original = os.dup(1)
    _results = os.fdopen(original, "w", closefd=False)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        _results.close()  # flushes; `original` stays open to be put back
        _results = None
        os.dup2(original, 1)
        os.close(original)


def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of `repeats` runs after one warm-up: the least noisy estimate on a shared box.
    Each run ends when the GPU's queued work does (CUDA kernels run asynchronously)."""
    fn()
    times = []
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def _synchronize() -> None:
    torch = sys.modules.get("torch")  # only a process that uses torch can have GPU work queued
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# `eagle-ray bench NAME`: (module, function, what it is given: the tiny target's path, options).
BENCHMARKS: dict[str, tuple[str, str, Callable[[str, Any], dict[str, Any]]]] = {
    "encodings": ("encodings", "run", lambda path, opts: {}),
    "backends": ("backends", "run", lambda path, opts: {"model_path": path}),
    "handoff": ("handoff", "run", lambda path, opts: {}),
    "engine-start": ("backends", "run_engine_start", lambda path, opts: {"model_path": path}),
    "pool": ("pool", "run_overhead", lambda path, opts: {
        "model_path": path, "shapes": [(8, 128), (16, 256), (8, 480)]}),
    "router": ("pool", "run_router", lambda path, opts: {}),
    "replica": ("replica", "run", lambda path, opts: {}),
    "scaling": ("pool", "run_scaling", lambda path, opts: {}),
    "transport": ("transport", "run", lambda path, opts: {}),
    "locality": ("locality", "run", lambda path, opts: {}),
    "autoscale": ("autoscale", "run", lambda path, opts: {}),
    "scale": ("scale", "run", lambda path, opts: {}),
    "train": ("train", "run", lambda path, opts: {"model_path": path}),
    "cache": ("cache", "run", lambda path, opts: {"model_path": path}),
    "ingest": ("ingest", "run", lambda path, opts: {
        "model_path": path, "sizes": tuple(opts.conversations)}),
    "soak": ("soak", "run", lambda path, opts: {"minutes": opts.minutes}),
    "gpu": ("gpu", "run", lambda path, opts: {"device": opts.device}),
    "self-check": ("self_check", "run", lambda path, opts: {"model_path": path}),
    # A draft learns only from a target that says something predictable: the pre-trained one.
    "drafts": ("drafts", "run", lambda path, opts: {"model_path": _pretrained(opts)}),
    "job": ("job", "run", lambda path, opts: {"seed": opts.seed}),
}

def _pretrained(options: Any) -> str:
    from eagle_ray.tiny import tiny_target

    return str(tiny_target(getattr(options, "arch", "llama"), pretrained=True))


# `--quick`: each benchmark at the smallest size that still runs all of its code (CI runs every
# one this way and checks the lines' shape, not the figures).
QUICK: dict[str, dict[str, Any]] = {
    "handoff": {"repeats": 1},
    "pool": {"shapes": [(4, 64)], "rounds": 1},
    "router": {"clients": (1, 2), "seconds": 1.0},
    "replica": {"hidden": 256, "tokens_per_call": 2048, "forward_s": 0.05, "calls": 4,
                "rounds": 1},
    "scaling": {"replica_counts": (1, 2)},
    "transport": {"tokens": 512, "hidden": 256, "repeats": 1},
    "locality": {"count": 4, "tokens": 256, "hidden": 256, "rounds": 1},
    "autoscale": {"max_replicas": 2, "trace_share": 0.1, "peak_trainers": 4},
    "scale": {"settings": ((1, 1), (4, 2)), "seconds": 2.0, "warm_up_s": 1.0, "nodes": 1,
              "lease_reuse_s": 0.5},
    "train": {"steps": 2, "rounds": 1, "seq": 64},
    "cache": {"micro_batches": 4},
    "ingest": {"sizes": (200,), "warm_up": 0},
    "soak": {"minutes": 0.1, "clients": 3, "cycle_faults": True},  # every fault: test_soak
    "gpu": {"small": True},
    "self-check": {"rows": 16, "tiny": False,  # one engine: both targets run the same code
                   "wide": {"hidden": 256, "vocab": 4096, "intermediate": 512, "heads": 4,
                            "kv_heads": 2}},
    "drafts": {"steps": 4, "ks": (3,), "prompts": 2, "max_new_tokens": 8, "rounds": 1,
               "samples": 16, "kinds": ("eagle3",)},  # every kind runs this code; each kind's
    # own training, export and serving are the job tests' (tests/train/test_train.py)
    "job": {"prompts": 2, "arms": ("as shipped",),
            "overrides": ("train.steps=4", "eval.num_speculative_tokens=[3]",
                          "eval.temperatures=[0.0]", "eval.max_new_tokens=8")},
}


def run(which: str, model_path: str, options: Any) -> Path | None:
    """Run benchmark `which` (a key of `BENCHMARKS`) on the tiny target at `model_path`
    (`options.quick`: at `QUICK`'s sizes; `options.save`: a folder that keeps the run's lines,
    returned as the file written — a run that fails keeps nothing)."""
    global _saved
    module, function, arguments = BENCHMARKS[which]
    quick = bool(getattr(options, "quick", False))
    kwargs = {**arguments(model_path, options), **(QUICK.get(which, {}) if quick else {})}
    save_to = getattr(options, "save", None)
    _saved = [] if save_to else None
    with results_only_on_stdout():
        try:
            getattr(importlib.import_module(f"eagle_ray.bench.{module}"), function)(**kwargs)
        finally:
            records, _saved = _saved, None
            ray = sys.modules.get("ray")  # `bench gpu` runs without Ray
            if ray is not None and ray.is_initialized():  # it prints what it held back
                ray.shutdown()
    if records is None:
        return None
    from eagle_ray.bench import results

    seed = getattr(options, "seed", 0)
    command = (["eagle-ray", "bench", which] + (["--quick"] if quick else [])
               + ([f"--seed {seed}"] if seed else []))
    return results.save(which, records, {"quick": quick, "command": " ".join(command)},
                        Path(save_to))
