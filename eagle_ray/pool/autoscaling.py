"""How many replicas a pool should have: a pure policy on a clock, tested without Ray.

Demand is the tokens leased to clients plus the tokens of lease requests waiting for room, the
signal that says how much target work the trainers want right now. The policy asks for
`ceil(demand / target_outstanding_tokens_per_replica)` replicas within `[min, max]`, and changes
the count only when that wish has pointed the same way for the whole delay (up: `upscale_delay_s`,
down: `downscale_delay_s`), so a noisy demand never makes the pool flap. Replicas still starting
(an engine loading, a placement group waiting for the autoscaler's node) count as supply, so a
slow node does not make it ask again and again.
"""

from __future__ import annotations

import dataclasses
import math

from eagle_ray.config.pool import AutoscalingConfig


@dataclasses.dataclass(frozen=True)
class ScalingDecision:
    """The replica count to move to now, and why (logged, shown in status)."""

    replicas: int
    reason: str


class AutoscalingPolicy:
    """Feed it `decide(now, demand_tokens, replicas)` at every tick; it answers a change or None."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._wish_since: float | None = None  # when the wish first pointed the current way
        self._wish_up: bool | None = None

    def wanted(self, demand_tokens: int) -> int:
        """Replicas for this demand, within the bounds."""
        needed = math.ceil(demand_tokens / self.config.target_outstanding_tokens_per_replica)
        return min(max(needed, self.config.min_replicas), self.config.max_replicas)

    def decide(self, now: float, demand_tokens: int, replicas: int) -> ScalingDecision | None:
        """A change once the wish has held for its delay; out-of-bounds counts are fixed at once."""
        cfg = self.config
        if not cfg.min_replicas <= replicas <= cfg.max_replicas:
            bounded = min(max(replicas, cfg.min_replicas), cfg.max_replicas)
            return ScalingDecision(bounded, f"{replicas} replicas is outside "
                                            f"[{cfg.min_replicas}, {cfg.max_replicas}]")
        wanted = self.wanted(demand_tokens)
        if wanted == replicas:
            self._wish_since = self._wish_up = None
            return None
        up = wanted > replicas
        if self._wish_up is not up:
            self._wish_since, self._wish_up = now, up
        delay = cfg.upscale_delay_s if up else cfg.downscale_delay_s
        if now - self._wish_since < delay:
            return None
        self._wish_since = self._wish_up = None
        per_replica = demand_tokens / max(replicas, 1)
        return ScalingDecision(wanted, (
            f"demand {demand_tokens} tokens = {per_replica:.0f} per replica, "
            f"{'above' if up else 'below'} the target "
            f"{cfg.target_outstanding_tokens_per_replica} for {delay:g}s"))
