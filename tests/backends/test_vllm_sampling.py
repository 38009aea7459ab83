"""Sampled speculative decoding on vLLM 0.32's CPU build: the rejection sampler's defect and
eagle_ray's fix (eagle_ray/backends/vllm/cpu_sampling.py), through the reproduction script."""

import json
import subprocess
import sys


def test_the_fixed_kernel_samples_the_targets_distribution_and_vllms_does_not():
    done = subprocess.run([sys.executable, "scripts/repro_vllm_sampling.py"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {(r["fixed"], r["seeded"]): r for r in map(json.loads, done.stdout.splitlines())}
    assert len(results) == 4
    for seeded in (False, True):
        fixed, shipped = results[True, seeded], results[False, seeded]
        # 20,000 draws of a Bernoulli(0.296): one standard deviation is 0.0032.
        assert abs(fixed["accept_rate"] - fixed["expected_accept_rate"]) < 0.015, fixed
        assert fixed["total_variation"] < 0.03, fixed
        # The control: vLLM's kernel accepts every draft, off the target's distribution.
        assert shipped["accept_rate"] > 0.9 and shipped["total_variation"] > 0.5, shipped
