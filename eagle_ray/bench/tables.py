"""docs/benchmarks.md, generated from the result files under `benchmarks/results/`
(`python -m eagle_ray.bench.tables > docs/benchmarks.md`; `tests/test_docs.py` fails when the file
is stale). No figure is typed by hand: per benchmark the question it answers (its docstring),
one table -- a line per setting, a column per metric in a readable unit, each cell the median
over the saved runs with its range and its ratio to the baseline the column names -- and a
conclusion computed from the ratios.

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
from eagle_ray.bench.markdown import table as markdown_table
from eagle_ray.bench.markdown import wrap
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


def figure(values: list[float], scale: float = 1.0) -> str:
    """The median, and the range when runs differ (each times `scale`)."""
    values = [v * scale for v in values]
    middle = _number(statistics.median(values))
    if len(values) == 1 or min(values) == max(values):
        return middle
    return f"{middle} ({_number(min(values))}-{_number(max(values))})"


def _number(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"


# A unit's readable scales, largest first: (smallest median shown in it, factor, name).
SCALES = {
    "s": [(1, 1, "s"), (1e-3, 1e3, "ms"), (1e-6, 1e6, "µs"), (0, 1e9, "ns")],
    "B": [(2**30, 2**-30, "GiB"), (2**20, 2**-20, "MiB"), (2**10, 2**-10, "KiB"), (0, 1, "B")],
    "B/s": [(1e9, 1e-9, "GB/s"), (1e6, 1e-6, "MB/s"), (1e3, 1e-3, "kB/s"), (0, 1, "B/s")],
}


def scaled_unit(unit: str, values: list[float]) -> tuple[float, str]:
    """(factor, unit) showing `values` in the unit's readable scale: s/token as µs/token,
    B/s as GB/s, B/token as KiB/token."""
    per_token = "/token" if unit.endswith("/token") else ""
    scales = SCALES.get(unit.removesuffix("/token"))
    if not scales or not values:
        return 1.0, unit
    middle = abs(statistics.median(values))
    smallest, factor, name = next(s for s in scales if middle >= s[0] or s[0] == 0)
    return factor, name + per_token


def line_keys(table: list[dict[str, Any]]) -> list[str]:
    """The parameters that tell a metric's rows apart (a table line each); the others are
    constant per metric and shown once (`constants`) or in their cells."""
    keys: set[str] = set()
    for metric in {row["metric"] for row in table}:
        rows_of = [row for row in table if row["metric"] == metric]
        keys |= {k for row in rows_of for k in row["parameters"]
                 if len({str(r["parameters"].get(k)) for r in rows_of}) > 1}
    return sorted(keys - {"baseline"})


def settings(table: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """The fields every row that carries them carries with one value, in every run (the run's
    settings, such as `minutes` or a fixed `forward_s`): said once above the table, not in it."""
    values: dict[str, set] = {}
    for row in table:
        for k, v in row["parameters"].items():
            values.setdefault(k, set()).add(str(v))
        for k, vs in row["measured"].items():
            values.setdefault(k, set()).update(_number(v) for v in vs)
    return {k: next(iter(v)) for k, v in values.items()
            if len(v) == 1 and k not in keys and k != "baseline"}


def pivot(table: list[dict[str, Any]]) -> tuple[list[str], list[tuple], dict]:
    """The rows of a benchmark as one table: a column per metric (and baseline, where one metric
    is compared against several), a line per setting of `line_keys`. Returns (those keys, the
    lines in first-seen order, {(line, column): row})."""
    keys = line_keys(table)
    baselines: dict[str, set] = {}
    for row in table:
        baselines.setdefault(row["metric"], set()).add(row["parameters"].get("baseline"))
    cells, lines = {}, []
    for row in table:
        line = tuple(row["parameters"].get(k) for k in keys)
        baseline = row["parameters"].get("baseline")
        # A column per baseline where a metric has several; rows without one (the baseline's
        # own) share the column of the metric's only named baseline.
        column = (row["metric"], baseline if len(baselines[row["metric"]] - {None}) > 1
                  else None)
        if line not in lines:
            lines.append(line)
        cells[line, column] = row
    return keys, lines, cells


def conclusion(table: list[dict[str, Any]]) -> str:
    """What the ratios say, computed: per compared metric and baseline, whether every run of
    every setting lies above it, below it, or which settings fall on which side (a setting
    whose runs lie on both sides of 1 is undecided by these runs)."""
    keys = line_keys(table)

    def setting(row: dict[str, Any]) -> str:
        return " ".join(f"{k}={row['parameters'][k]}" for k in keys
                        if row["parameters"].get(k) is not None)

    def detail(compared: list[dict[str, Any]]) -> str:
        ordered = sorted(compared, key=lambda r: statistics.median(r["ratios"]))
        ratios = [f"{_number(statistics.median(r['ratios']))}x" for r in ordered]
        at = [f" at {setting(r)}" if setting(r) else "" for r in ordered]
        if len(ordered) > 3:
            return f"from {ratios[0]}{at[0]} to {ratios[-1]}{at[-1]}"
        return ", ".join(r + a for r, a in zip(ratios, at, strict=True))

    parts = []
    for metric, baseline in dict.fromkeys((row["metric"], row["parameters"].get("baseline"))
                                          for row in table):
        compared = [row for row in table if row["metric"] == metric and row["ratios"]
                    and row["parameters"].get("baseline") == baseline
                    and any(r != 1 for r in row["ratios"])]
        if not compared or baseline is None:
            continue
        sides = {"above": [r for r in compared if min(r["ratios"]) > 1],
                 "below": [r for r in compared if max(r["ratios"]) < 1]}
        sides["not told apart (runs on both sides)"] = [
            r for r in compared if r not in sides["above"] and r not in sides["below"]]
        every = "in every run" + (" at every setting" if len(compared) > 1 else "")
        whole = next((side for side, rs in sides.items() if len(rs) == len(compared)), None)
        if whole in ("above", "below"):
            parts.append(f"`{metric}` is {whole} {baseline} {every} ({detail(compared)})")
        elif whole:
            parts.append(f"`{metric}` is not told apart from {baseline} by these runs, which "
                         f"fall on both sides of it ({detail(compared)})")
        else:
            parts.append(f"`{metric}` against {baseline}: " + "; ".join(
                f"{side} at {len(rs)} of {len(compared)} settings ({detail(rs)})"
                for side, rs in sides.items() if rs))
    return ("**In short:** " + "; ".join(parts) + ".") if parts else ""


def _published(which: str, runs: list[list[dict[str, Any]]]) -> None:
    """Refuse runs that cannot stand as published figures (too few for a ratio)."""
    if any(record.get("ratio") is not None for run in runs for record in run) \
            and len(runs) < MIN_RUNS_FOR_A_RATIO:
        raise StaleResults(f"bench {which}: {len(runs)} saved run(s); a ratio is published as "
                           f"the median of at least {MIN_RUNS_FOR_A_RATIO} (run "
                           f"`eagle-ray bench {which} --save` again)")


def provenance(runs: list[list[dict[str, Any]]], fixed: dict[str, Any]) -> str:
    """Which runs a table summarises: how many, when, from which commits, on what machine, with
    what command and settings."""
    first = runs[0][0]
    machines = {(r[0]["machine"]["cores"], r[0]["machine"]["cpu"], r[0]["machine"]["memory_gib"],
                 r[0]["machine"]["gpu"]) for r in runs}
    return (f"{len(runs)} run{'s' if len(runs) > 1 else ''}, "
            f"{min(r[0]['date'] for r in runs)[:10]} to {max(r[0]['date'] for r in runs)[:10]}, "
            f"commits {', '.join(sorted({r[0]['commit'] for r in runs}))}; "
            + "; ".join(f"{cores} cores ({cpu}), {memory} GiB" + (f", {gpu}" if gpu else "")
                        for cores, cpu, memory, gpu in sorted(machines, key=str))
            + f"; `{first['options']['command']}`"
            + "".join(f"; {k} {v}" for k, v in fixed.items()) + ".")


def _extra(row: dict[str, Any], key: str) -> str | None:
    if key in row["measured"]:
        return _number(statistics.median(row["measured"][key]))
    return None if row["parameters"].get(key) is None else str(row["parameters"][key])


def section(which: str, runs: list[list[dict[str, Any]]]) -> list[str]:
    """A benchmark's heading, the question it answers, the runs it summarises, its table (a line
    per setting, a column per metric in a readable unit with its ratio, a column per other
    figure measured) and its conclusion."""
    _published(which, runs)
    table = rows(runs)
    keys, lines, cells = pivot(table)
    fixed = settings(table, keys)
    columns = list(dict.fromkeys(column for _, column in cells))
    extras = [k for k in dict.fromkeys(k for row in table
                                       for k in [*row["parameters"], *row["measured"]])
              if k not in keys and k not in fixed and k != "baseline"]
    headers, scales = [], {}
    for metric, baseline in columns:
        rows_of = [row for (_, c), row in cells.items() if c == (metric, baseline)]
        factor, unit = scaled_unit(rows_of[0]["unit"],
                                   [statistics.median(r["values"]) for r in rows_of])
        scales[metric, baseline] = factor
        against = baseline or next((r["parameters"].get("baseline") for r in rows_of
                                    if r["ratios"]), None)
        headers.append(f"{metric} ({unit}" + (f"; x {against}" if against else "") + ")")
    body = []
    for line in lines:
        of_line = [row for (at, _), row in cells.items() if at == line]
        cell_texts = ["" if v is None else str(v) for v in line]
        for column in columns:
            row = cells.get((line, column))
            cell = "" if row is None else figure(row["values"], scales[column])
            if row is not None and row["ratios"] and row["parameters"].get("baseline"):
                cell += f" · {figure(row['ratios'])}x"
            cell_texts.append(cell)
        for key in extras:
            found = dict.fromkeys(v for v in (_extra(row, key) for row in of_line) if v)
            cell_texts.append(" / ".join(found))
        body.append(cell_texts)
    summary = conclusion(table)
    return ([f"## `eagle-ray bench {which}`", "", wrap(description(which)), "",
             wrap(provenance(runs, fixed)), ""] + markdown_table(keys, headers + extras, body)
            + ([""] + [wrap(summary)] if summary else []) + [""])


def render(directory: Path = RESULTS_DIR) -> str:
    """docs/benchmarks.md for the runs saved under `directory`."""
    saved = load(directory)
    lines = ["# Benchmarks", "",
             "<!-- generated by `python -m eagle_ray.bench.tables > docs/benchmarks.md` from "
             "benchmarks/results/; do not edit -->", "",
             wrap("Every figure is the median over the saved runs of its benchmark (range in "
                  "brackets; `· 1.2x` is its ratio to the baseline its column names), each run "
                  "measuring its comparisons side by side (`eagle-ray bench NAME --save`, from "
                  "committed code only; testing.md says how CI runs every benchmark with "
                  f"`--quick`). A ratio is published from at least {MIN_RUNS_FOR_A_RATIO} runs. "
                  "These are a shared 2-core CPU machine's figures unless a GPU is named: "
                  "compare within a table, not across machines. Settings every line shares are "
                  "said once, above the table."), ""]
    for which in BENCHMARKS:
        if which in saved:
            lines += section(which, saved[which])
    missing = [w for w in BENCHMARKS if w not in saved]
    if missing:
        lines += ["## Not measured here yet", "",
                  "No saved runs yet (`eagle-ray bench NAME --save` adds them):", ""]
        lines += [wrap(f"- `{w}`: {description(w)}") for w in missing] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
