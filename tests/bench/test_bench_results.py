"""Benchmark results as files (`eagle-ray bench NAME --save`) and the tables generated from them
(docs/benchmarks.md): a figure is the median of the saved runs, a ratio needs three of them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_ray.bench import markdown, results, tables
from eagle_ray.bench.results import load, save

EAGLE_RAY = str(Path(sys.executable).parent / "eagle-ray")


def test_a_saved_run_is_its_result_lines_with_commit_machine_and_date(tmp_path):
    done = subprocess.run([EAGLE_RAY, "bench", "encodings", "--save", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    [path] = (tmp_path / "encodings").glob("*.jsonl")
    saved = [json.loads(line) for line in path.read_text().splitlines()]
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert [{k: r[k] for k in p} for r, p in zip(saved, printed, strict=True)] == printed
    run = saved[0]
    assert run["machine"]["cores"] >= 1 and run["machine"]["memory_gib"] > 0
    assert run["date"].startswith("20") and run["commit"]
    assert run["options"] == {"quick": False, "command": "eagle-ray bench encodings"}
    assert str(path) in done.stderr  # the log says where the run went


def _run(directory: Path, values: list[float], ratio: bool = True, quick: bool = False) -> None:
    records = [{"bench": "scaling", "metric": "supervision_tokens_per_s", "value": v,
                "unit": "tok/s", "replicas": n + 1, "busy": v / 100,
                **({"baseline": "linear", "ratio": v / values[0]} if ratio else {})}
               for n, v in enumerate(values)]
    save("scaling", records, {"quick": quick, "command": "eagle-ray bench scaling"}, directory)


def test_a_figure_is_the_median_of_the_runs_with_their_range(tmp_path):
    for values in ([100, 150], [110, 200], [90, 170]):
        _run(tmp_path, values)
    _run(tmp_path, [1, 1], quick=True)  # CI's quick runs are not results
    assert len(load(tmp_path)["scaling"]) == 3
    first, second = tables.rows(load(tmp_path)["scaling"])
    assert first["parameters"] == {"baseline": "linear", "replicas": 1}
    assert tables.figure(first["values"]) == "100 (90-110)"
    assert tables.figure(second["ratios"]) == "1.818 (1.5-1.889)"
    assert second["measured"] == {"busy": [1.5, 2.0, 1.7]}
    page = tables.render(tmp_path)
    # One table: a line per setting, a column per metric naming its unit and baseline.
    assert "| replicas | supervision_tokens_per_s (tok/s; x linear) | busy |" in page
    assert "| 2 | 170 (150-200) · 1.818 (1.5-1.889)x | 1.7 |" in page
    assert ("**In short:** `supervision_tokens_per_s` is above linear in every run (1.818x at "
            "replicas=2).") in page


def test_a_ratio_from_fewer_than_three_runs_is_not_published(tmp_path):
    for values in ([100, 150], [110, 200]):
        _run(tmp_path, values)
    with pytest.raises(tables.StaleResults, match="at least 3"):
        tables.render(tmp_path)
    _run(tmp_path / "plain", [100, 150], ratio=False)  # a figure without a ratio: one run is
    assert "170" not in tables.render(tmp_path / "plain")  # published as it is
    assert "| 2 | 150 | 1.5 |" in tables.render(tmp_path / "plain")


def test_units_are_scaled_to_read():
    assert tables.scaled_unit("s/token", [2.5e-9, 2e-6]) == (1e6, "µs/token")
    assert tables.scaled_unit("B/s", [3.2e9]) == (1e-9, "GB/s")
    assert tables.scaled_unit("B/token", [32768]) == (2**-10, "KiB/token")
    assert tables.scaled_unit("tok/s", [1234.0]) == (1.0, "tok/s")
    assert tables.figure([2.5e-6, 3e-6, 2e-6], 1e6) == "2.5 (2-3)"


def test_runs_whose_lines_do_not_match_are_refused(tmp_path):
    _run(tmp_path, [100, 150])
    _run(tmp_path, [100, 150])
    _run(tmp_path, [100])  # a run with other options in the same folder
    with pytest.raises(tables.StaleResults, match="different options"):
        tables.render(tmp_path)


def test_the_conclusion_says_on_which_side_of_the_baseline_every_run_lies(tmp_path):
    for values in ([100, 150, 80], [100, 200, 120], [100, 170, 90]):
        _run(tmp_path, values)
    page = " ".join(tables.render(tmp_path).split())  # prose is wrapped
    assert ("`supervision_tokens_per_s` against linear: above at 1 of 2 settings (1.7x at "
            "replicas=2); not told apart (runs on both sides) at 1 of 2 settings") in page
    for values in ([100, 150, 120], [100, 200, 130], [100, 170, 110]):  # control: all above
        _run(tmp_path / "above", values)
    assert "is above linear in every run at every setting" in " ".join(
        tables.render(tmp_path / "above").split())


def test_settings_every_line_shares_are_said_once_above_the_table(tmp_path):
    for values in ([100, 150], [110, 200], [90, 170]):
        records = [{"bench": "scaling", "metric": "supervision_tokens_per_s", "value": v,
                    "unit": "tok/s", "replicas": n + 1, "minutes": 1.0, "clients": 4}
                   for n, v in enumerate(values)]
        save("scaling", records, {"quick": False, "command": "eagle-ray bench scaling"},
             tmp_path)
    page = tables.render(tmp_path)
    assert "; clients 4; minutes 1." in page
    assert "| replicas | supervision_tokens_per_s (tok/s) |" in page  # no column of settings
    assert "| 2 | 170 (150-200) |" in page


def test_a_wide_table_is_split_and_a_single_setting_turned_on_its_side():
    columns = [f"a_long_metric_name_{i} (micro-batches)" for i in range(17)]
    split = markdown.table(["clients"], columns, [["4"] + [f"{i},000 (9-99)" for i in range(17)]])
    assert max(len(line) for line in split) <= markdown.MAX_LINE
    assert sum(line.startswith("| clients |") for line in split) > 1  # several tables
    assert all(f"{i},000 (9-99)" in "\n".join(split) for i in range(17))  # nothing dropped
    single = markdown.table([], columns, [[str(i) for i in range(17)]])
    assert single[0] == "| figure | value |" and len(single) == 2 + 17
    assert "| a_long_metric_name_16 (micro-batches) | 16 |" in single


def test_only_committed_code_saves_into_the_repositorys_results(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(results, "commit", lambda: "0123456789ab-dirty")
    with pytest.raises(ValueError, match="uncommitted changes"):
        save("scaling", [{"metric": "m", "value": 1}], {"quick": False}, tmp_path)
    assert not list(tmp_path.glob("*/*.jsonl"))
    save("scaling", [{"metric": "m", "value": 1}], {"quick": False}, tmp_path / "elsewhere")
    monkeypatch.setattr(results, "commit", lambda: "0123456789ab")  # control: committed code
    assert save("scaling", [{"metric": "m", "value": 1}], {"quick": False}, tmp_path).exists()
