"""The autoscaling policy on a simulated clock: a demand trace in, replica counts out."""

import random

import pytest

from eagle_ray.config import ConfigError
from eagle_ray.config.pool import AutoscalingConfig
from eagle_ray.pool.autoscaling import AutoscalingPolicy

TARGET = 100


def policy(**overrides) -> AutoscalingPolicy:
    config = {"min_replicas": 1, "max_replicas": 4, "target_outstanding_tokens_per_replica":
              TARGET, "upscale_delay_s": 10, "downscale_delay_s": 60, **overrides}
    return AutoscalingPolicy(AutoscalingConfig(**config))


def run(trace, start_replicas=1, step_s=1.0, **overrides) -> list[int]:
    """Replica count after each tick of `trace` (demand tokens per tick), applying decisions."""
    scaler, replicas, counts = policy(**overrides), start_replicas, []
    for tick, demand in enumerate(trace):
        decision = scaler.decide(tick * step_s, demand, replicas)
        if decision is not None:
            replicas = decision.replicas
        counts.append(replicas)
    return counts


def test_sustained_demand_scales_up_after_the_delay_and_down_after_its_own():
    counts = run([350] * 30 + [0] * 100)
    assert counts[9] == 1, "not before upscale_delay_s"
    assert counts[10] == 4, "ceil(350 / 100) = 4 replicas once demand held for 10 s"
    assert counts[89] == 4 and counts[90] == 1, "down only after downscale_delay_s of low demand"


def test_bounds_are_respected_whatever_the_demand():
    assert max(run([10_000] * 50)) == 4
    assert min(run([0] * 200, start_replicas=3)) == 1
    assert run([0] * 5, start_replicas=0, min_replicas=2)[0] == 2, "below min: fixed at once"
    assert run([0], start_replicas=9)[0] == 4, "above max: fixed at once"


def test_a_noisy_demand_around_the_target_never_flaps():
    rng = random.Random(0)
    trace = [rng.choice([80, 120]) for _ in range(600)]  # wishes 1 or 2, never for 10 s running
    counts = run(trace, downscale_delay_s=10)
    changes = sum(a != b for a, b in zip(counts, counts[1:], strict=False))
    assert changes == 0, counts


def test_a_short_dip_restarts_the_downscale_clock():
    trace = [0] * 50 + [250] + [0] * 70
    counts = run(trace, start_replicas=3)
    assert counts[59] == 3 and counts[110] == 3 and counts[111] == 1


def test_the_decision_says_why():
    scaler = policy(upscale_delay_s=0)
    decision = scaler.decide(0.0, 350, 1)
    assert decision.replicas == 4
    assert "demand 350 tokens" in decision.reason and "above the target 100" in decision.reason


@pytest.mark.parametrize("bad", [{"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 0},
                                 {"target_outstanding_tokens_per_replica": 0},
                                 {"upscale_delay_s": -1}, {"interval_s": 0}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        AutoscalingConfig(**bad)
