"""A benchmark's stdout is its JSON result lines alone: what else is written to file descriptor 1
while it runs (Ray's raylet warnings, vLLM's engine logs, child processes) goes to stderr."""

import json
import subprocess
import sys

NOISY_BENCHMARK = """
import os, subprocess, sys
from eagle_ray.bench import emit, results_only_on_stdout
print("before")
with results_only_on_stdout():
    print("(raylet) WARNING: a print")
    os.write(1, b"a write to fd 1\\n")
    subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
    emit("noisy", "rate", 1.5, "x", ratio=2.0)
    print("more engine log")
    emit("noisy", "rate", 2.5, "x")
print("after")
"""


def test_only_result_lines_reach_stdout_while_a_benchmark_runs():
    done = subprocess.run([sys.executable, "-c", NOISY_BENCHMARK], capture_output=True,
                          text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "before" and lines[-1] == "after", "stdout is restored afterwards"
    assert [json.loads(line)["value"] for line in lines[1:-1]] == [1.5, 2.5]
    for noise in ("(raylet) WARNING: a print", "a write to fd 1", "a child process",
                  "more engine log"):
        assert noise in done.stderr and noise not in done.stdout
