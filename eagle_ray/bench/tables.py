"""docs/benchmarks.md, generated from the result files under `benchmarks/results/`
(`python -m eagle_ray.bench.tables > docs/benchmarks.md`; `tests/test_docs.py` fails when the file
is stale). No figure is typed by hand: every cell is the median over the saved runs of one
benchmark, with the range beside it.

A run's lines are matched across runs by position (the n-th line with a given metric), so runs
saved with different options must not share a folder: delete superseded files when a benchmark
changes (git keeps them).
"""

from __future__ import annotations

import importlib
import inspect
import statistics
import sys
from pathlib import Path
from typing import Any

from eagle_ray.bench import BENCHMARKS
from eagle_ray.bench.results import RESULTS_DIR, load

MIN_RUNS_FOR_A_RATIO = 3  # a ratio is published as the median of at least this many runs
RUN_FIELDS = {"bench", "metric", "value", "unit", "ratio", "commit", "machine", "date", "options"}


class StaleResults(ValueError):
    """The saved runs of a benchmark cannot be published as they are (the message says why)."""


def description(which: str) -> str:
    """What benchmark `which` measures: its function's docstring where a module holds several
    benchmarks, else the module's."""
    module_name, function, _ = BENCHMARKS[which]
    module = importlib.import_module(f"eagle_ray.bench.{module_name}")
    shared = sum(entry[0] == module_name for entry in BENCHMARKS.values()) > 1
    doc = inspect.getdoc(getattr(module, function)) if shared else None
    return " ".join((doc or inspect.getdoc(module) or "").split("\n\n")[0].split())


def rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per result line, its figures over all runs: value and ratio as lists, the fields
    that identify it as `parameters`, the other numeric fields as `measured` lists."""
    keyed: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        seen: dict[str, int] = {}
        for record in run:
            n = seen[record["metric"]] = seen.get(record["metric"], -1) + 1
            keyed.setdefault((record["metric"], n), []).append(record)
    table = []
    for (metric, _), records in keyed.items():
        if len(records) != len(runs):
            raise StaleResults(f"{metric}: in {len(records)} of {len(runs)} runs; runs with "
                               f"different options share a folder")
        extra = {k for r in records for k in r} - RUN_FIELDS
        # What identifies the row (a shape, a path, a count of clients) is a string, a flag or
        # an integer every run agrees on; anything else is something the run measured.
        same = {k for k in extra if all(r.get(k) == records[0].get(k) for r in records)
                and (records[0].get(k) is None
                     or isinstance(records[0][k], str | bool | int))}
        table.append({
            "metric": metric, "unit": records[0]["unit"],
            "values": [r["value"] for r in records],
            "ratios": [r["ratio"] for r in records if r.get("ratio") is not None],
            "parameters": {k: records[0][k] for k in sorted(same) if records[0].get(k) is not None},
            "measured": {k: [r[k] for r in records] for k in sorted(extra - same)
                         if all(isinstance(r.get(k), int | float) for r in records)},
        })
    return table


def figure(values: list[float]) -> str:
    """The median, and the range when runs differ."""
    middle = _number(statistics.median(values))
    if len(values) == 1 or min(values) == max(values):
        return middle
    return f"{middle} ({_number(min(values))}-{_number(max(values))})"


def _number(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"


def section(which: str, runs: list[list[dict[str, Any]]]) -> list[str]:
    """A benchmark's heading, description, the runs it summarises and its table."""
    table = rows(runs)
    if any(row["ratios"] for row in table) and len(runs) < MIN_RUNS_FOR_A_RATIO:
        raise StaleResults(f"bench {which}: {len(runs)} saved run(s); a ratio is published as "
                           f"the median of at least {MIN_RUNS_FOR_A_RATIO} (run "
                           f"`eagle-ray bench {which} --save` again)")
    first = runs[0][0]
    machines = {(r[0]["machine"]["cores"], r[0]["machine"]["cpu"], r[0]["machine"]["memory_gib"],
                 r[0]["machine"]["gpu"]) for r in runs}
    lines = [f"## `eagle-ray bench {which}`", "", description(which), "",
             f"{len(runs)} runs, {min(r[0]['date'] for r in runs)} to "
             f"{max(r[0]['date'] for r in runs)}, commits "
             f"{', '.join(sorted({r[0]['commit'] for r in runs}))}; "
             + "; ".join(f"{cores} cores ({cpu}), {memory} GiB" + (f", {gpu}" if gpu else "")
                         for cores, cpu, memory, gpu in sorted(machines, key=str))
             + f"; `{first['options']['command']}`.", "",
             "| metric | parameters | value (median, range) | unit | ratio (median, range) "
             "| also measured (median) |", "|---|---|---|---|---|---|"]
    for row in table:
        parameters = ", ".join(f"{k}={v}" for k, v in row["parameters"].items())
        measured = ", ".join(f"{k}={_number(statistics.median(v))}"
                             for k, v in row["measured"].items())
        ratio = figure(row["ratios"]) if row["ratios"] else ""
        lines.append(f"| {row['metric']} | {parameters} | {figure(row['values'])} | "
                     f"{row['unit']} | {ratio} | {measured} |")
    return lines + [""]


def render(directory: Path = RESULTS_DIR) -> str:
    """docs/benchmarks.md for the runs saved under `directory`."""
    saved = load(directory)
    lines = ["# Benchmarks", "",
             "<!-- generated by `python -m eagle_ray.bench.tables > docs/benchmarks.md` from "
             "benchmarks/results/; do not edit -->", "",
             "Every figure is the median over the saved runs of its benchmark (range in "
             "brackets), each run measuring its comparisons side by side "
             "(`eagle-ray bench NAME --save`; testing.md says how CI runs every benchmark "
             f"with `--quick`). A ratio is published from at least {MIN_RUNS_FOR_A_RATIO} runs. "
             "These are a shared 2-core CPU machine's figures unless a GPU is named: compare "
             "within a table, not across machines.", ""]
    for which in BENCHMARKS:
        if which in saved:
            lines += section(which, saved[which])
    missing = [w for w in BENCHMARKS if w not in saved]
    if missing:
        lines += ["## Not measured here yet", "",
                  "No saved runs yet (`eagle-ray bench NAME --save` adds them):", ""]
        lines += [f"- `{w}`: {description(w)}" for w in missing] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
