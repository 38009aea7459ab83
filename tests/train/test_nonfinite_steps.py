"""A non-finite loss or gradient writes nothing (issue 53, item 3): the training loop's learner
skips the step (no weight, no optimizer state written from it, its gradient dropped), counts it,
stops after `train.max_nonfinite_steps` in a row, and under DDP every rank skips the same steps.
Each with its control: finite steps train as before."""

import copy
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle_ray.config import ConfigError, JobConfig
from eagle_ray.train import nonfinite
from eagle_ray.train.loop import DraftLearner, MetricsWindow, TimedIterator
from eagle_ray.train.nonfinite import NonFiniteTraining

from learner_helpers import tiny_batch as batch
from learner_helpers import tiny_learner

WORLD = 2


def learner(max_nonfinite_steps: int = 5, prepare=None) -> DraftLearner:
    return tiny_learner(prepare=prepare, steps=20, warmup_steps=1,
                        max_nonfinite_steps=max_nonfinite_steps)


def weights(trained: DraftLearner) -> dict[str, torch.Tensor]:
    return copy.deepcopy(trained.draft.state_dict())


def optimizer_state(trained: DraftLearner) -> list[torch.Tensor]:
    return [t.clone() for part in trained.optimizer.parts for s in part.state.values()
            for t in s.values()]


def same(a, b) -> bool:
    """Equal tensors, in order (`a`, `b`: lists, or dicts of the same keys)."""
    if isinstance(a, dict):
        a, b = list(a.values()), list(b.values())
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("poison", ["aux_hidden_states", "last_hidden", None])
def test_a_non_finite_step_writes_nothing_and_is_counted(poison):
    trained = learner()
    trained.step(batch(0))
    before, moments = weights(trained), optimizer_state(trained)
    values = trained.step(batch(1, poison))
    if poison is None:  # the control: a finite step writes the weights and AdamW's state
        assert not trained.skipped and trained.guard.skipped == 0
        assert not same(weights(trained), before) and not same(optimizer_state(trained), moments)
        return
    assert not torch.isfinite(values["loss"])
    assert trained.skipped and (trained.guard.skipped, trained.guard.in_a_row) == (1, 1)
    assert same(weights(trained), before) and same(optimizer_state(trained), moments)
    assert all(p.grad is None for p in trained.params), "its gradient is dropped"
    assert trained.optimizer.scheduled_steps == 2, "the schedule advances with the loop's steps"
    trained.step(batch(2))  # the next finite step trains, from the weights before the NaN
    assert not trained.skipped and trained.guard.in_a_row == 0 and trained.guard.skipped == 1
    after = weights(trained)
    assert not same(after, before) and all(torch.isfinite(t).all() for t in after.values())


def test_max_nonfinite_steps_in_a_row_stop_with_the_error_and_fewer_do_not():
    trained = learner(max_nonfinite_steps=3)
    trained.step(batch(0))
    # The control: two in a row, a finite step, two more: never three in a row.
    for poison in ["aux_hidden_states", "aux_hidden_states", None, "last_hidden", "last_hidden"]:
        trained.step(batch(1, poison))
    assert trained.guard.skipped == 4 and trained.guard.in_a_row == 2
    kept = weights(trained)
    with pytest.raises(NonFiniteTraining, match=r"3 optimizer steps in a row \(up to step 7\).*"
                       r"train.max_nonfinite_steps = 3"):
        trained.step(batch(2, "aux_hidden_states"))
    assert same(weights(trained), kept)


def test_the_window_averages_finite_steps_and_reports_the_count():
    window = MetricsWindow(TimedIterator(iter(())), world=1)
    finite = {"loss": torch.tensor(2.0), "acc_0": torch.tensor(0.5)}
    window.add_values({"loss": torch.tensor(float("nan")), "acc_0": torch.tensor(0.0)},
                      skipped=True)
    window.add_values(finite)
    metrics, _ = window.flush(2, 1e-4, nonfinite_steps=1)
    assert (metrics["loss"], metrics["acc_0"], metrics["nonfinite_steps"]) == (2.0, 0.5, 1)
    window.add_values(finite, skipped=True)  # a window of skipped steps only: no value, NaN
    metrics, _ = window.flush(3, 1e-4, nonfinite_steps=2)
    assert math.isnan(metrics["loss"]) and metrics["nonfinite_steps"] == 2


def test_the_config_key_has_a_default_and_refuses_zero():
    assert JobConfig().train.max_nonfinite_steps == 5
    with pytest.raises(ConfigError, match="train.max_nonfinite_steps must be >= 1, got 0"):
        JobConfig(train={"max_nonfinite_steps": 0})


def _rank(rank: int, store: str, out: str) -> None:
    """One of `WORLD` gloo ranks: rank 1's second batch holds a NaN, rank 0's is finite.
    Saves what each scenario left: plain learners with the guard's all-reduce, the same with
    it taken out (the control), and DDP-wrapped learners."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results = {}
    all_reduce = dist.all_reduce
    for scenario in ("agreed", "control", "ddp"):
        if scenario == "control":
            nonfinite.dist.all_reduce = lambda *args, **kwargs: None
        prepare = torch.nn.parallel.DistributedDataParallel if scenario == "ddp" else None
        trained = learner(prepare=prepare)
        trained.step(batch(0))
        before = weights(trained)
        trained.step(batch(1, "aux_hidden_states" if rank == 1 else None))
        results[scenario] = {"skipped": trained.skipped, "count": trained.guard.skipped,
                             "unchanged": same(weights(trained), before)}
        trained.step(batch(2 + rank))
        results[scenario]["weights"] = weights(trained)
        nonfinite.dist.all_reduce = all_reduce
    torch.save(results, f"{out}-{rank}.pt")
    dist.destroy_process_group()


def test_every_ddp_rank_skips_the_step_one_rank_found_non_finite(tmp_path):
    out = str(tmp_path / "rank")
    context = mp.start_processes(_rank, args=(str(tmp_path / "store"), out), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "the ranks did not finish"
    ranks = [torch.load(f"{out}-{r}.pt", weights_only=False) for r in range(WORLD)]
    for scenario in ("agreed", "ddp"):  # rank 0's own step was finite: it skips all the same
        assert [(r[scenario]["skipped"], r[scenario]["count"], r[scenario]["unchanged"])
                for r in ranks] == [(True, 1, True)] * WORLD, scenario
    # The control: without the all-reduce, rank 0 writes its step and the ranks diverge.
    assert [(r["control"]["skipped"], r["control"]["unchanged"]) for r in ranks] == \
        [(False, False), (True, True)]
    # DDP keeps the ranks equal through the skip and the step after it.
    assert same(ranks[0]["ddp"]["weights"], ranks[1]["ddp"]["weights"])
