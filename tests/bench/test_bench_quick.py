"""Every `eagle-ray bench` subcommand runs in CI in its quick mode (`--quick`: the smallest sizes
that run all of its code), so a benchmark cannot break unnoticed; what is checked is the shape of
its JSON lines, never the figures (performance lives in the full runs, docs/benchmarks.md)."""

import argparse
import importlib
import inspect
import subprocess

import pytest

from eagle_ray import bench
from eagle_ray.bench import BENCHMARKS, QUICK

from bench_lines import EAGLE_RAY, result_lines

pytestmark = pytest.mark.slow


def test_result_lines_are_checked_for_their_fields():
    """The control: a line without a unit, or with a non-numeric value, fails the check."""
    result_lines('{"bench": "b", "metric": "m", "value": 1.5, "unit": "s"}')
    for broken in ('{"bench": "b", "metric": "m", "value": 1.5}',
                   '{"bench": "b", "metric": "m", "value": "fast", "unit": "s"}',
                   '{"bench": "b", "metric": "m", "value": 1, "unit": "s", "baseline": "x"}'):
        with pytest.raises((AssertionError, KeyError)):
            result_lines(broken)


# gpu: test_bench_gpu runs it; soak: test_soak runs its quick mode and checks what it reports;
# engine-start: two engine starts (in-process, multiprocess) and nothing else, which every vLLM
# test makes (CI time); job: a whole job per arm (CI time; test_train checks its lines on the
# main job's summary). Their arguments are checked below like every benchmark's.
NOT_RUN_HERE = {"gpu", "soak", "engine-start", "job"}


def test_every_benchmark_takes_its_quick_arguments(monkeypatch):
    """Each entry names a function that accepts what `eagle-ray bench NAME --quick` passes."""
    monkeypatch.setattr(bench, "_pretrained", lambda options: "/model")  # no kit built here
    options = argparse.Namespace(conversations=[200], minutes=0.1, device="cpu", arch="llama",
                                 seed=0)
    for which, (module, function, arguments) in BENCHMARKS.items():
        run = getattr(importlib.import_module(f"eagle_ray.bench.{module}"), function)
        kwargs = {**arguments("/model", options), **QUICK.get(which, {})}
        inspect.signature(run).bind(**kwargs)  # TypeError names what does not fit


@pytest.mark.parametrize("which", sorted(set(BENCHMARKS) - NOT_RUN_HERE))
def test_every_benchmark_runs_in_quick_mode(which):
    done = subprocess.run([EAGLE_RAY, "bench", which, "--quick"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = result_lines(done.stdout)
    assert records, f"bench {which} printed no result"
