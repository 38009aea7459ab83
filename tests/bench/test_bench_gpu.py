"""`eagle-ray bench gpu --device cpu --quick`: the GPU check's code runs in CI, and what it
reports says what the device paths must hold -- with Ray, and on a machine like the lent GPU
machine, which has torch and transformers but neither Ray nor vLLM."""

import json
import subprocess
import sys

# Imports of Ray and vLLM fail as where neither is installed.
BLOCK_RAY_AND_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, Block())
"""
QUICK_GPU_CHECK = ("import sys\nfrom eagle_ray.cli import main\n"
                   "sys.exit(main(['bench', 'gpu', '--device', 'cpu', '--quick']))\n")
# The one check that needs Ray, alone (the others run in the test without Ray below: run twice
# they would cost CI a minute and check nothing more).
POOL_CHECK = ("import torch\nfrom eagle_ray.bench import results_only_on_stdout\n"
              "from eagle_ray.bench.gpu import pool_vs_in_process\n"
              "with results_only_on_stdout():\n"
              "    pool_vs_in_process(torch.device('cpu'), small=True)\n")
SKIPPED_POOL = "the pool comparison is skipped: Ray is not importable"


def run_python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def quick_gpu_check(prelude: str = "", check: str = QUICK_GPU_CHECK
                    ) -> tuple[dict[str, list[dict]], str]:
    """The quick check's result lines by metric, and its log (stderr)."""
    done = run_python(prelude + check)
    assert done.returncode == 0, done.stderr[-3000:]
    by_metric: dict[str, list[dict]] = {}
    for result in map(json.loads, done.stdout.splitlines()):
        by_metric.setdefault(result["metric"], []).append(result)
    return by_metric, done.stderr


def assert_the_checks_without_ray(by_metric: dict[str, list[dict]]) -> None:
    """What every check that needs no Ray reports."""
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


def test_the_gpu_checks_pool_comparison_runs_where_ray_is():
    """The quick check's pool comparison (a one-replica HF pool against the backend in process),
    as `bench gpu` runs it on a machine with Ray."""
    by_metric, log = quick_gpu_check(check=POOL_CHECK)
    pool = {r["path"]: r for r in by_metric["pool_supervision_tokens_per_s"]}
    assert set(pool) == {"in_process", "pool_1_replica"} and pool["in_process"]["ratio"] == 1.0
    assert SKIPPED_POOL not in log


def test_without_ray_or_vllm_every_other_check_runs_and_the_pool_one_says_it_is_skipped():
    """As on the lent GPU machine: the learner step included, and nothing imports vLLM."""
    by_metric, log = quick_gpu_check(BLOCK_RAY_AND_VLLM)
    assert_the_checks_without_ray(by_metric)
    assert "pool_supervision_tokens_per_s" not in by_metric
    assert SKIPPED_POOL in log


def test_the_blocker_leaves_neither_ray_nor_vllm_importable():
    """The control for the test above: its prelude does block them, and only them."""
    for name in ("ray", "ray.train", "vllm"):
        done = run_python(BLOCK_RAY_AND_VLLM + f"import {name}", timeout=120)
        assert done.returncode != 0 and "blocked by the test" in done.stderr, name
    done = run_python(BLOCK_RAY_AND_VLLM + "import torch, transformers, eagle_ray.cli",
                      timeout=120)
    assert done.returncode == 0, done.stderr
