"""The end of a run as a person reads it: a summary table with the command that serves the
draft, and `report.png` (training curves, acceptance per draft position, throughput).
`summary.json` stays the machine-readable record; both are made from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPORT_SIZE_PX = (1500, 800)
DISAGREEMENT = 0.25  # acceptance length between vLLM and the simulation worth a line


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


def acceptance_lines(report: dict[str, Any]) -> list[str]:
    """The acceptance table: one column per (k, temperature) vLLM measured (95 % interval over
    prompts), the simulation beside it, and acceptance per draft position at the largest k."""
    measured, simulated = report.get("vllm") or [], report.get("simulated") or []
    columns = measured or simulated
    width = 18
    lines = [f"  acceptance  length (1 + accepted / verify steps) on {report['prompts']} prompts "
             f"({report['turns']} turns){'; 95% interval over prompts' if measured else ''}",
             _row("", [_setting(c) for c in columns], width)]
    by_setting = {_setting(r): r for r in simulated}
    if measured:
        lines.append(_row("vLLM, trained draft", [_with_interval(r) for r in measured], width))
    for name in ("trained", "untrained"):
        lines.append(_row(f"simulated, {name}", [
            by_setting[_setting(c)][name] if _setting(c) in by_setting else "-"
            for c in columns], width))
    if any("trained_expected" in r for r in simulated):  # sampled: the exact expectation
        lines.append(_row("exact, trained", [
            by_setting.get(_setting(c), {}).get("trained_expected", "-") for c in columns], width))
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
    apart = [_setting(r) for r in measured if _setting(r) in by_setting and abs(
        r["mean_acceptance_length"] - by_setting[_setting(r)]["trained"]) > DISAGREEMENT]
    if apart:
        lines.append(f"    vLLM and the simulation disagree at {'; '.join(apart)} "
                     f"(docs/training.md, \"Evaluation\": vLLM's sampled speculative "
                     f"decoding on the CPU build)")
    series = per_position_series(report)
    if series:
        k = max(len(values) for _, values in series)
        lines.append(_row("accepted at position", [f"#{j + 1}" for j in range(k)]))
        lines += [_row(f"  {label}", list(values)) for label, values in series]
    return lines


def per_position_series(report: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """Acceptance per draft position at the largest k: each temperature vLLM measured and
    simulated (the trained and the untrained draft)."""
    rows = (report.get("vllm") or []) + (report.get("simulated") or [])
    if not rows:
        return []
    k = max(r["num_speculative_tokens"] for r in rows)
    series = [(f"vLLM, t={r['temperature']:g}", r["acceptance_per_position"])
              for r in report.get("vllm") or [] if r["num_speculative_tokens"] == k]
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
        lines += ["  serve it with vLLM as the target's EAGLE-3 draft:",
                  f"    {summary['serve_command']}"]
    return "\n".join(lines)


def write_report_png(summary: dict[str, Any], metrics: list[dict[str, Any]],
                     path: str | Path) -> Path:
    """`report.png`: loss and accuracy per TTT step over training, supervision tokens/s and
    wait shares; the acceptance table (`acceptance_lines`: length per k and temperature with its
    interval), and acceptance per draft position at the largest k (vLLM per temperature, the
    simulation of the trained and the untrained draft)."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    width, height = REPORT_SIZE_PX
    fig, axes = plt.subplots(2, 3, figsize=(width / 100, height / 100), dpi=100)
    steps = [m["step"] for m in metrics]
    ttt = len(_ttt_values(metrics[-1], "loss")) if metrics else 0
    for ax, name, title in ((axes[0, 0], "loss", "loss per TTT step"),
                            (axes[0, 1], "acc", "accuracy per TTT step")):
        for k in range(ttt):
            ax.plot(steps, [m[f"{name}_{k}"] for m in metrics], label=f"step {k}")
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.legend(fontsize=8)
    axes[1, 0].axis("off")
    if summary.get("eval"):
        axes[1, 0].text(0, 1, "\n".join(line[2:] for line in acceptance_lines(summary["eval"])),
                        family="monospace", fontsize=6.5, va="top")
    axes[1, 0].set_title("acceptance length (1 + accepted / verify steps)")
    ax = axes[1, 1]
    series = per_position_series(summary.get("eval") or {})
    if series:
        k = max(len(values) for _, values in series)
        positions = list(range(1, k + 1))
        bar = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            ax.bar([p + (i - (len(series) - 1) / 2) * bar for p in positions[:len(values)]],
                   values, bar, label=label)
        ax.set_xticks(positions)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    ax.set_title("acceptance rate per draft position")
    ax.set_xlabel("draft position")
    ax = axes[0, 2]
    ax.plot(steps, [m["supervision_tokens_per_s"] for m in metrics], color="tab:blue")
    ax.set_ylabel("supervision tok/s", color="tab:blue")
    ax.set_xlabel("training step")
    ax.set_title("throughput and waiting")
    shares = ax.twinx()
    for key, colour in (("pool_wait_share", "tab:red"), ("data_wait_share", "tab:orange")):
        shares.plot(steps, [m.get(key, 0.0) for m in metrics], color=colour,
                    label=key.replace("_", " "))
    shares.set_ylim(0, 1)
    shares.legend(fontsize=8, loc="upper right")
    axes[1, 2].axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
