"""The end of a run as a person reads it: a summary table with the command that serves the
draft, and `report.png` (training curves, acceptance per draft position, throughput).
`summary.json` stays the machine-readable record; both are made from it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

REPORT_SIZE_PX = (1500, 800)
TRAINING_ONLY_SIZE_PX = (1500, 440)  # a run that did not evaluate: the training row alone
DISAGREEMENT = 0.25  # acceptance length between vLLM and the simulation worth a line
# Sampled: vLLM's length this many standard errors from the exact expectation on its own answers
# disagrees (a vLLM that samples as speculative sampling says lies past it in 0.3 % of settings).
AGREEMENT_Z = 3.0


def _kind_title(kind: str) -> str:
    from eagle_ray.draft.kinds import draft_class  # the summary needs no torch until here

    return draft_class(kind).title


def _ttt_values(metrics: dict[str, Any], name: str) -> list[float]:
    steps = sorted(int(k.rsplit("_", 1)[1]) for k in metrics
                   if k.startswith(f"{name}_") and k.rsplit("_", 1)[1].isdigit())
    return [metrics[f"{name}_{k}"] for k in steps]


def _row(label: str, values: list[Any], width: int = 8) -> str:
    cells = "".join(f"{v:>{width}.2f}" if isinstance(v, float) else f"{v!s:>{width}}"
                    for v in values)
    return f"    {label:<28}{cells}"


def _setting(row: dict[str, Any]) -> str:
    return f"k={row['num_speculative_tokens']}, t={row['temperature']:g}"


def _with_interval(row: dict[str, Any]) -> str:
    low, high = row["interval_95"]
    interval = "" if low != low else f" [{low:.2f}-{high:.2f}]"  # NaN: one prompt
    return f"{row['mean_acceptance_length']:.2f}{interval}"


def exact_expectation(row: dict[str, Any]) -> tuple[float, tuple[float, float]]:
    """A simulated row's exact expected length of the trained draft and its 95 % range: greedy,
    the deterministic simulation; sampled, the expectation on vLLM's own answers where the
    evaluation replayed them (the range vLLM's figure falls in), else on the simulation's."""
    paired = row.get("trained_on_vllm_answers")
    if paired is not None:
        return paired["expected"], tuple(paired["interval_95"])
    if "trained_expected" in row:
        return row["trained_expected"], tuple(row["trained_expected_interval_95"])
    return row["trained"], (row["trained"], row["trained"])


def _exact(row: dict[str, Any]) -> str | float:
    """The table's cell: greedy, the figure alone (it is deterministic); sampled, with the range
    vLLM's figure falls in."""
    if "trained_expected" not in row:
        return row["trained"]
    value, (low, high) = exact_expectation(row)
    return f"{value:.2f} [{low:.2f}-{high:.2f}]"


def paired_deviation(measured: dict[str, Any], paired: dict[str, Any]) -> float:
    """Standard errors between vLLM's length and the exact expectation on its own answers."""
    gap = measured["mean_acceptance_length"] - paired["expected"]
    if paired["standard_error"] > 0:
        return gap / paired["standard_error"]
    return 0.0 if abs(gap) < 1e-9 else math.copysign(math.inf, gap)


def vllm_agrees(measured: dict[str, Any], simulated: dict[str, Any]) -> bool:
    """Whether vLLM's acceptance length agrees with the exact expectation: greedy within
    `DISAGREEMENT`; sampled, within `AGREEMENT_Z` standard errors of the expectation on vLLM's
    own answers (a paired comparison: which answers were sampled cancels). A summary without
    that replay falls back to the weak test of the simulation's own answers: vLLM's interval
    over prompts overlapping the exact figure's range."""
    if "trained_expected" not in simulated:
        return abs(measured["mean_acceptance_length"] - simulated["trained"]) <= DISAGREEMENT
    paired = simulated.get("trained_on_vllm_answers")
    if paired is not None:
        return abs(paired_deviation(measured, paired)) <= AGREEMENT_Z
    low, high = measured["interval_95"]
    if low != low:  # one prompt: no interval, the point instead
        low = high = measured["mean_acceptance_length"]
    exact_low, exact_high = simulated["trained_expected_interval_95"]
    return low <= exact_high and exact_low <= high


def acceptance_lines(report: dict[str, Any]) -> list[str]:
    """The acceptance table: one column per (k, temperature) vLLM measured (95 % interval over
    prompts), the exact expectation (sampled: with its 95 % range) and the simulation beside
    it, and acceptance per draft position at the largest k; above it how sure the target is."""
    measured, simulated = report.get("vllm") or [], report.get("simulated") or []
    columns = measured or simulated
    width = 18
    lines = []
    if "target_top_probability" in report:
        lines.append(f"  target      top probability along its greedy answers "
                     f"{report['target_top_probability']:.2f} (near 1, sampling picks what "
                     f"greedy does)")
    if "draft" in report:  # what parallel drafting is for
        draft = report["draft"]
        seconds = draft.get("seconds_per_verify_step", {})
        lines.append(f"  draft       {_kind_title(draft['kind'])}: per verify step "
                     + ", ".join(("forwards not counted" if n is None else f"{n:g} forward(s)")
                                 + (f" {1e3 * seconds[k]:.1f} ms"
                                    if k in seconds else "") + f" at k={k}"
                                 for k, n in draft["forwards_per_verify_step"].items())
                     + ("" if draft.get("drafts_as_its_kind") is not False
                        else " (counted in vLLM: not what its kind runs)"))
    answers = max([r.get("answers_per_prompt", 1) for r in measured] or [1])
    each = f", {answers} sampled answers each at t > 0" if answers > 1 else ""
    lines += [f"  acceptance  length (1 + accepted / verify steps) on {report['prompts']} "
              f"prompts ({report['turns']} turns{each}){'; 95% intervals' if measured else ''}",
              _row("", [_setting(c) for c in columns], width)]
    by_setting = {_setting(r): r for r in simulated}
    if measured:
        lines.append(_row("vLLM, trained draft", [_with_interval(r) for r in measured], width))
    if simulated:
        lines.append(_row("exact, trained", [
            _exact(by_setting[_setting(c)]) if _setting(c) in by_setting else "-"
            for c in columns], width))
    for name in ("trained", "untrained"):
        lines.append(_row(f"simulated, {name}", [
            by_setting[_setting(c)][name] if _setting(c) in by_setting else "-"
            for c in columns], width))
    if measured:
        lines.append(_row("greedy output unchanged", [
            f"{r['greedy_equal_fraction']:.0%}" if "greedy_equal_fraction" in r else "-"
            for r in measured], width))
    # A prompt that fails does so before either measurement sends it: the most of any row.
    problems = {"failed prompts": max([report.get("failed_prompts", 0),
                                       *(r.get("failed", 0) for r in measured)]),
                "unreadable lines": sum((report.get("skipped_lines") or {}).values())}
    if any(problems.values()):
        lines.append("    " + ", ".join(f"{count} {what}" for what, count in problems.items()))
    apart = [_setting(r) for r in measured if _setting(r) in by_setting
             and not vllm_agrees(r, by_setting[_setting(r)])]
    if apart:
        lines.append(f"    vLLM and the exact expectation disagree at {'; '.join(apart)} "
                     f"(docs/training.md, \"vLLM at temperature 1\")")
    series = per_position_series(report)
    if series:
        k = max(len(values) for _, values in series)
        lines.append(_row("accepted at position", [f"#{j + 1}" for j in range(k)]))
        lines += [_row(f"  {label}", list(values)) for label, values in series]
    return lines


def per_position_series(report: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """Acceptance per draft position at the largest k: each temperature vLLM measured, the exact
    expectation on vLLM's sampled answers, and simulated (the trained and the untrained draft)."""
    rows = (report.get("vllm") or []) + (report.get("simulated") or [])
    if not rows:
        return []
    k = max(r["num_speculative_tokens"] for r in rows)
    series = [(f"vLLM, t={r['temperature']:g}", r["acceptance_per_position"])
              for r in report.get("vllm") or [] if r["num_speculative_tokens"] == k]
    series += [(f"exact on its answers, t={r['temperature']:g}",
                r["trained_on_vllm_answers"]["acceptance_per_position"])
               for r in report.get("simulated") or [] if r["num_speculative_tokens"] == k
               and "trained_on_vllm_answers" in r]
    series += [(f"simulated, t={r['temperature']:g}, {name}",
                r[f"acceptance_per_position_{name}"])
               for r in report.get("simulated") or [] if r["num_speculative_tokens"] == k
               for name in ("trained", "untrained")]
    return series


def format_summary(summary: dict[str, Any]) -> str:
    """The summary table (plain text)."""
    lines = [f"eagle_ray run {summary.get('run_name', '')} -- summary"]
    data = summary.get("data", {})
    dropped = sum(v for k, v in data.items() if k.startswith("dropped"))
    lines.append(f"  data        {data.get('kept', 0):,} conversations trained on, "
                 f"{data.get('truncated', 0):,} truncated, {dropped:,} dropped "
                 f"({data.get('training_tokens', 0):,} tokens)")
    regenerated = summary.get("regenerated")
    if regenerated:
        total = regenerated["conversations"] + regenerated["resumed"]
        lines.append(f"  answers     regenerated by the target: {total:,} conversations, "
                     f"{regenerated['changed_share']:.0%} changed, {regenerated['failed']} "
                     f"failed")
    final = summary.get("final_metrics") or {}
    if final:
        losses, accuracies = _ttt_values(final, "loss"), _ttt_values(final, "acc")
        lines += [f"  training    {final.get('step')} steps; final window:",
                  _row("TTT step", list(range(len(losses)))),
                  _row("loss", losses), _row("accuracy", accuracies),
                  f"    supervision {final.get('supervision_tokens_per_s', 0):,.0f} tok/s; "
                  f"trainers waited on the pool {final.get('pool_wait_share', 0):.0%} and on "
                  f"the data {final.get('data_wait_share', 0):.0%} of step time"]
    if summary.get("eval"):
        lines += acceptance_lines(summary["eval"])
    lines.append(f"  draft       {summary['draft_dir']}")
    for label, key in (("report", "report"), ("log", "log_file")):
        if summary.get(key):
            lines.append(f"  {label:<12}{summary[key]}")
    if summary.get("serve_command"):
        kind = _kind_title(summary.get("draft_kind", "eagle3"))
        lines += [f"  serve it with vLLM as the target's {kind} draft:",
                  f"    {summary['serve_command']}"]
    return "\n".join(lines)


def write_report_png(summary: dict[str, Any], metrics: list[dict[str, Any]],
                     path: str | Path) -> Path:
    """`report.png`: above, loss and accuracy per TTT step over training and supervision
    tokens/s with the wait shares; below (when the run evaluated), the acceptance length per k
    and temperature (vLLM and the exact expectation with their 95 % intervals, the untrained
    draft), and acceptance per draft position at the largest k at the lowest and the highest
    temperature. The numbers themselves are in the console's table: no text panel."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    report = summary.get("eval") or {}
    rows = report.get("vllm") or report.get("simulated") or []
    temperatures = sorted({r["temperature"] for r in rows})
    temperatures = temperatures[:1] + temperatures[1:][-1:]  # the lowest and the highest
    width, height = REPORT_SIZE_PX if rows else TRAINING_ONLY_SIZE_PX
    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
    grid = fig.add_gridspec(2 if rows else 1, 6)
    top = [fig.add_subplot(grid[0, 2 * i: 2 * i + 2]) for i in range(3)]
    _training_panels(top, metrics)
    if rows:
        span = 6 // (1 + len(temperatures))
        bottom = [fig.add_subplot(grid[1, span * i: span * (i + 1)])
                  for i in range(1 + len(temperatures))]
        _length_panel(bottom[0], report)
        k = max(r["num_speculative_tokens"] for r in rows)
        for ax, temperature in zip(bottom[1:], temperatures, strict=True):
            _position_panel(ax, report, k, temperature)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _training_panels(axes: list, metrics: list[dict[str, Any]]) -> None:
    steps = [m["step"] for m in metrics]
    ttt = len(_ttt_values(metrics[-1], "loss")) if metrics else 0
    for ax, name, title in ((axes[0], "loss", "loss per TTT step"),
                            (axes[1], "acc", "accuracy per TTT step")):
        for k in range(ttt):
            ax.plot(steps, [m[f"{name}_{k}"] for m in metrics], label=f"step {k}")
        ax.set_title(title)
        ax.set_xlabel("training step")
        if ttt:
            ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    ax.plot(steps, [m["supervision_tokens_per_s"] for m in metrics], color="tab:blue")
    ax.set_ylabel("supervision tok/s", color="tab:blue")
    ax.set_xlabel("training step")
    ax.set_title("throughput and waiting")
    shares = ax.twinx()
    for key, colour in (("pool_wait_share", "tab:red"), ("data_wait_share", "tab:orange")):
        shares.plot(steps, [m.get(key, 0.0) for m in metrics], color=colour,
                    label=key.replace("_", " "))
    _headroom(shares, 1.0)  # the legend above the curves
    shares.set_ylabel("share of step time")
    shares.legend(fontsize=7, loc="upper right", ncol=2)


def _bars(ax, groups: list[str], series: list[tuple[str, list[float], list | None]],
          ymax: float) -> None:
    """Grouped bars (`series`: label, one value per group, optional (low, high) per group),
    with headroom above them for the legend."""
    bar = 0.8 / len(series)
    for i, (label, values, intervals) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * bar for g in range(len(groups))]
        errors = None
        if intervals:  # NaN bounds (one prompt): no bar
            pairs = list(zip(values, intervals, strict=True))
            errors = [[max(v - lo, 0) if lo == lo else 0 for v, (lo, _) in pairs],
                      [max(hi - v, 0) if hi == hi else 0 for v, (_, hi) in pairs]]
        ax.bar(xs, values, bar, yerr=errors, capsize=2, label=label)
    ax.set_xticks(range(len(groups)), groups)
    _headroom(ax, ymax)
    ax.legend(fontsize=7, loc="upper center", ncol=2)


def _headroom(ax, ymax: float) -> None:
    """Room above `ymax` for a legend, with no tick past `ymax` (a share never reads 1.2)."""
    ax.set_ylim(0, ymax * 1.35)
    ax.set_yticks([tick for tick in ax.get_yticks() if 0 <= tick <= ymax * 1.0001])


def _length_panel(ax, report: dict[str, Any]) -> None:
    measured, simulated = report.get("vllm") or [], report.get("simulated") or []
    by_setting = {_setting(r): r for r in simulated}
    columns = [_setting(r) for r in (measured or simulated)]
    series = []
    if measured:
        series.append(("vLLM", [r["mean_acceptance_length"] for r in measured],
                       [r["interval_95"] for r in measured]))
    if simulated:
        rows = [by_setting[c] for c in columns]
        exact = [exact_expectation(r) for r in rows]
        series.append(("exact, trained", [value for value, _ in exact],
                       [bounds for _, bounds in exact]))
        series.append(("simulated, untrained", [r["untrained"] for r in rows], None))
    top = max(max(values) for _, values, _ in series)
    top = max([top] + [high for _, _, bounds in series for _, high in bounds or [] if high == high])
    _bars(ax, [c.replace(", ", "\n") for c in columns], series, top)
    ax.set_title("acceptance length (1 + accepted / verify steps)")


def _position_panel(ax, report: dict[str, Any], k: int, temperature: float) -> None:
    def at(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((r for r in rows if r["num_speculative_tokens"] == k
                     and r["temperature"] == temperature), None)

    measured, simulated = at(report.get("vllm") or []), at(report.get("simulated") or [])
    series = []
    if measured:
        series.append(("vLLM", measured["acceptance_per_position"], None))
    if simulated and "trained_on_vllm_answers" in simulated:
        series.append(("exact on vLLM's answers",
                       simulated["trained_on_vllm_answers"]["acceptance_per_position"], None))
    if simulated:
        series += [(f"simulated, {name}", simulated[f"acceptance_per_position_{name}"], None)
                   for name in ("trained", "untrained")]
    _bars(ax, [f"#{j + 1}" for j in range(k)], series, 1.0)
    ax.set_title(f"accepted per draft position, k={k}, t={temperature:g}")
    ax.set_xlabel("draft position")
