"""The main job end to end (`eagle-ray train --config examples/tiny.yaml`, as `make run` runs it)
and two variants of it on the same data and steps, each from the same seed: what the draft it
trains accepts when vLLM serves it (k = 3 and 7, greedy and at temperature 1, beside the exact
expectation and the untrained draft) and where its training ends (loss and accuracy of TTT
step 0). The variants: fp8 supervision (`target.encoding_dtype: fp8`, ratios against the job as
shipped) and training on the data's own answers (`regenerate.enabled: false`). One run is one
seed (`--seed`): the saved runs' range is the spread of training a tiny draft from another seed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from eagle_ray.bench import emit

logger = logging.getLogger(__name__)

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
SHIPPED = "as shipped"
# Each arm: the overrides it adds to the job as shipped.
ARMS: dict[str, tuple[str, ...]] = {
    SHIPPED: (),
    "fp8 supervision": ("target.encoding_dtype=fp8",),
    "the data's own answers": ("regenerate.enabled=false",),
}


def run(seed: int = 0, prompts: int = 16, arms: tuple[str, ...] = tuple(ARMS),
        overrides: tuple[str, ...] = ()) -> None:
    """Each arm as its own `eagle-ray train` process (what a user runs), evaluated on `prompts`
    held-out prompts (the job holds out 16); `overrides` apply to every arm (quick runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        summaries = {}
        for arm in arms:
            output = Path(tmp) / str(len(summaries))
            command = [sys.executable, "-m", "eagle_ray.cli", "train", "--config", str(CONFIG),
                       f"output_dir={output}", f"train.seed={seed}", f"eval.prompts={prompts}",
                       *ARMS[arm], *overrides]
            logger.info("%s: %s", arm, " ".join(command[3:]))
            subprocess.run(command, check=True, stdout=sys.stderr)
            summaries[arm] = json.loads((output / "summary.json").read_text())
    shipped = summaries.get(SHIPPED)
    for arm, summary in summaries.items():
        for record in summary_lines(arm, summary, shipped):
            emit(**record)


def summary_lines(arm: str, summary: dict[str, Any], shipped: dict[str, Any] | None = None
                  ) -> list[dict[str, Any]]:
    """The result lines of one job's `summary.json` (`shipped`: the job as shipped, which
    acceptance lengths are compared with)."""
    final = summary["final_metrics"]
    lines = [{"bench": "job", "metric": "final_loss_step_0", "value": round(final["loss_0"], 4),
              "unit": "nats", "arm": arm},
             {"bench": "job", "metric": "final_accuracy_step_0",
              "value": round(final["acc_0"], 4), "unit": "share", "arm": arm}]
    baseline = _acceptance(shipped) if shipped is not None and arm != SHIPPED else {}
    for (k, t), figures in _acceptance(summary).items():
        for metric, value in figures.items():
            line = {"bench": "job", "metric": metric, "value": round(value, 4),
                    "unit": "tokens/step", "arm": arm, "k": k, "temperature": f"{t:g}"}
            if metric.startswith("vllm") and (k, t) in baseline:
                line |= {"baseline": SHIPPED,
                         "ratio": round(value / baseline[k, t][metric], 4)}
            lines.append(line)
    return lines


def _acceptance(summary: dict[str, Any]) -> dict[tuple[int, float], dict[str, float]]:
    """Per (k, t): vLLM's acceptance length, the exact expectation (greedy: the deterministic
    simulation; sampled: on vLLM's own answers where the summary has it) and the untrained
    draft's."""
    from eagle_ray.train.report import exact_expectation

    evaluation = summary["eval"]
    vllm = {(r["num_speculative_tokens"], r["temperature"]): r["mean_acceptance_length"]
            for r in evaluation["vllm"]}
    out = {}
    for row in evaluation["simulated"]:
        key = (row["num_speculative_tokens"], row["temperature"])
        out[key] = {"vllm_acceptance_length": vllm[key],
                    "exact_acceptance_length": exact_expectation(row)[0],
                    "untrained_acceptance_length": row.get("untrained_expected",
                                                           row["untrained"])}
    return out
