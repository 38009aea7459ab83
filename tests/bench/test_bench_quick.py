"""Every `eagle-ray bench` subcommand runs in CI in its quick mode (`--quick`: the smallest sizes
that run all of its code), so a benchmark cannot break unnoticed; what is checked is the shape of
its JSON lines, never the figures (performance lives in the full runs, docs/benchmarks.md)."""

import subprocess

import pytest

from eagle_ray.bench import BENCHMARKS

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


# gpu: test_bench_gpu runs it; soak: test_soak runs its quick mode and checks what it reports.
@pytest.mark.parametrize("which", sorted(set(BENCHMARKS) - {"gpu", "soak"}))
def test_every_benchmark_runs_in_quick_mode(which):
    done = subprocess.run([EAGLE_RAY, "bench", which, "--quick"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = result_lines(done.stdout)
    assert records, f"bench {which} printed no result"
