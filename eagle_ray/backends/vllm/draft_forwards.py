"""The draft model's forwards, counted inside vLLM's engine while it serves a draft: what the
evaluation reports as draft forwards per verify step (vLLM's own spec-decode metrics count
drafts and tokens, not forwards).

What vLLM 0.32's V1 model runner runs (`vllm/v1/spec_decode/llm_base_proposer.py`,
`SpecDecodeBaseProposer.propose`, which EAGLE-3, P-EAGLE and DFlash share) for one proposal --
the drafts of every running request that the next verify step checks: one forward of the draft
over the step's new tokens (:600; after a prefill those are the prompt's, so the draft's prefill
is this forward, not one more); then, for a chain, k - 1 forwards of one token each (:689,
:754); with `parallel_drafting` it returns after the first (:629), which drafted all k. P-EAGLE
sets the flag (`DraftServing.speculative_config`); the `dflash` method sets it itself
(`vllm/config/speculative.py:1468`), its one forward over the bonus token and k mask slots
(`dflash.py:126`) after writing the context's keys and values (`precompute_and_store_context_kv`,
`dflash.py:283`, part of that pass, not a forward of its own). `dummy_run` (profiling, warm-up)
forwards outside `propose`: not counted.

How: `EXTENSION` is the engine's `worker_extension_cls` (vLLM adds its methods to every worker).
`start_counting(llm)` has each worker wrap its drafter: its `propose`, and the class of its
`model` (whatever vLLM wrapped the draft in: a CUDA-graph wrapper is called once per forward
too), so that each proposal adds the draft module's calls made inside it. `read(llm)` reads
the counts back from the engine's processes; every tensor-parallel rank runs the same passes,
so rank 0's are taken (counted once) and the others checked against them.

Not counted: vLLM's V2 model runner (a GPU's default where Triton is installed) has no V1
drafter and replays a chain's steps from CUDA graphs (not one Python call per forward); there
`start_counting` is False and `read` None (not measured).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

EXTENSION = "eagle_ray.backends.vllm.draft_forwards.DraftForwardsExtension"
COUNTER = "_eagle_ray_draft_forwards"  # the drafter's attribute holding its `DraftForwards`
CALLS = "_eagle_ray_calls"  # the draft module's attribute: its calls so far
_counted_classes: dict[type, type] = {}


@dataclasses.dataclass
class DraftForwards:
    """Counts since `start_counting`: `proposals` (engine steps that drafted), the draft
    module's `forwards` inside them, and `requests` drafted for (summed over proposals: one
    per verify step vLLM counts in `num_drafts`, and one never verified per request that
    ended)."""

    proposals: int = 0
    forwards: int = 0
    requests: int = 0

    def __sub__(self, other: DraftForwards) -> DraftForwards:
        return DraftForwards(self.proposals - other.proposals, self.forwards - other.forwards,
                             self.requests - other.requests)

    def __add__(self, other: DraftForwards) -> DraftForwards:
        return DraftForwards(self.proposals + other.proposals, self.forwards + other.forwards,
                             self.requests + other.requests)

    def per_verify_step(self) -> float | None:
        """Draft forwards per proposal (what one verify step checks); None before any."""
        return self.forwards / self.proposals if self.proposals else None


def _counted_class(cls: type) -> type:
    """`cls` with each call counted on the instance (`CALLS`); its forward is untouched."""
    if cls not in _counted_classes:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 (the protocol's)
            setattr(self, CALLS, getattr(self, CALLS, 0) + 1)
            return super(counted, self).__call__(*args, **kwargs)

        counted = type(f"Counted{cls.__name__}", (cls,), {"__call__": __call__})
        _counted_classes[cls] = counted
    return _counted_classes[cls]


def _count_calls(module: Any) -> None:
    if type(module) not in _counted_classes.values():
        module.__class__ = _counted_class(type(module))


def count_draft_forwards(drafter: Any) -> bool:
    """Wrap `drafter` (a V1 proposer: a `propose` that calls `drafter.model`) so each of its
    proposals is counted on it (`COUNTER`); True once counting. Idempotent."""
    if drafter is None or not hasattr(drafter, "model") or not hasattr(drafter, "propose"):
        return False
    if hasattr(drafter, COUNTER):
        return True
    counts = DraftForwards()
    propose = drafter.propose

    def counted_propose(*args: Any, **kwargs: Any) -> Any:
        _count_calls(drafter.model)  # vLLM may have swapped the module since (graph wrappers)
        before = getattr(drafter.model, CALLS, 0)
        draft_token_ids = propose(*args, **kwargs)
        counts.proposals += 1
        counts.forwards += getattr(drafter.model, CALLS, 0) - before
        counts.requests += int(draft_token_ids.shape[0])
        return draft_token_ids

    setattr(drafter, COUNTER, counts)
    drafter.propose = counted_propose
    return True


class DraftForwardsExtension:
    """Methods vLLM adds to each worker (`worker_extension_cls`), called through
    `llm.collective_rpc`: they run in the worker's process, where the drafter is."""

    def eagle_ray_count_draft_forwards(self) -> bool:
        """Start counting this worker's draft forwards (False: no V1 drafter here)."""
        return count_draft_forwards(getattr(self.model_runner, "drafter", None))  # type: ignore[attr-defined]

    def eagle_ray_draft_forwards(self) -> dict[str, int] | None:
        """This worker's counts and tensor-parallel rank, or None when not counting."""
        from vllm.distributed import get_tensor_model_parallel_rank

        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        counts = getattr(drafter, COUNTER, None)
        if counts is None:
            return None
        return {"rank": get_tensor_model_parallel_rank(), **dataclasses.asdict(counts)}


def start_counting(llm: Any) -> bool:
    """Have every worker of `llm` (built with `worker_extension_cls=EXTENSION`) count its
    draft forwards from now on; False where a worker cannot (logged)."""
    counting = all(llm.collective_rpc("eagle_ray_count_draft_forwards"))
    if not counting:
        logger.warning("draft forwards are not counted in this engine (no V1 drafter: vLLM's "
                       "V2 model runner?); the evaluation reports them as not measured")
    return counting


def read(llm: Any) -> DraftForwards | None:
    """The draft forwards `llm` has run since `start_counting`, counted once (rank 0's; the
    other ranks run the same passes, and a rank that does not is logged); None if not
    counting."""
    replies = llm.collective_rpc("eagle_ray_draft_forwards")
    if not replies or any(reply is None for reply in replies):
        return None
    by_rank = {reply.pop("rank"): DraftForwards(**reply) for reply in replies}
    counts = by_rank[0]
    for rank, other in by_rank.items():
        if other != counts:
            logger.warning("tensor-parallel rank %d counted %s draft forwards, rank 0 %s", rank,
                           other, counts)
    return counts


def since(llm: Any, before: DraftForwards | None) -> dict[str, int] | None:
    """What `llm` counted since `before` (a `read`), as a report's row keeps it; None if not
    counting."""
    now = read(llm)
    if now is None or before is None:
        return None
    return dataclasses.asdict(now - before)
