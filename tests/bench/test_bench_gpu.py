"""`eagle-ray bench gpu --device cpu --quick`: the GPU check's code runs in CI, and what it
reports says what the device paths must hold."""

import json
import subprocess
import sys


def test_the_gpu_check_runs_on_the_cpu_at_small_shapes():
    done = subprocess.run([sys.executable, "-m", "eagle_ray.cli", "bench", "gpu", "--device",
                           "cpu", "--quick"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    by_metric: dict[str, list[dict]] = {}
    for result in results:
        by_metric.setdefault(result["metric"], []).append(result)
    # The same weights on the same device: identical in fp32, close in bf16, every encoding.
    fp32 = by_metric["max_abs_diff_vs_cpu"]
    assert {r["encoding"] for r in fp32} == {"logits", "last_hidden", "target_probs"}
    # ... in both layouts: states on the device (HF) and captured into host memory (vLLM).
    assert {r["layout"] for r in fp32} == {"hf", "vllm"}
    assert all(r["value"] == 0.0 for r in fp32), fp32
    assert all(r["value"] > 0.99 for r in by_metric["min_cosine_vs_cpu_fp32"])
    assert {r["returned_on"] for r in by_metric["supervision_tokens_per_s"]} == {"device", "cpu"}
    steps = {(r["attention"], r["precision"]) for r in by_metric["draft_step_peak_gib"]}
    assert steps == {(a, p) for a in ("linear", "materialised") for p in ("bf16", "fp32")}
    assert by_metric["self_check_refused_right"][0]["value"] == 0  # no false alarm
    assert by_metric["learner_step_tokens_per_s"][0]["value"] > 0  # the loop's own learner
    assert {r["encoding_dtype"] for r in by_metric["to_host_seconds"]} == {"auto", "fp8"}
    pool = {r["path"]: r for r in by_metric["pool_supervision_tokens_per_s"]}
    assert set(pool) == {"in_process", "pool_1_replica"} and pool["in_process"]["ratio"] == 1.0
