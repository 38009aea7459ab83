"""`train.optimizer` (eagle_ray/train/optimizers.py): Muon takes the drafts' weight matrices as
speculators 0.9 splits them, AdamW the rest; a Muon step is an orthogonalised update; both
optimizers follow the schedule; and a learner checkpointed and resumed takes the same next steps
as one never interrupted, under Muon as under AdamW (a checkpoint from before the choice
existed too)."""

import contextlib
from pathlib import Path

import pytest
import torch

from eagle_ray.config import TrainConfig
from eagle_ray.draft.dflash import DFlashDraft
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.draft.peagle import PEagleDraft
from eagle_ray.train.loop import CHECKPOINT_FILE
from eagle_ray.train.optimizers import DraftOptimizer, muon_split

from learner_helpers import tiny_batch, tiny_learner
from loss_oracles import speculators_module

CONFIG = DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=48,
                     draft_vocab_size=48, num_layers=2)
DRAFTS = {"eagle3": lambda: Eagle3Draft(CONFIG), "peagle": lambda: PEagleDraft(CONFIG, 0),
          "dflash": lambda: DFlashDraft(CONFIG, 0)}


class DirectoryCheckpoint:
    """What `DraftLearner.resume` reads of Ray Train's checkpoint: a folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def as_directory(self):
        yield str(self.path)


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_muon_takes_the_weight_matrices_and_adamw_the_rest_as_speculators_splits(kind):
    draft = DRAFTS[kind]()
    names = {id(p): n for n, p in draft.named_parameters()}
    muon, adamw = muon_split(draft)
    muon_names, adamw_names = {names[id(p)] for p in muon}, {names[id(p)] for p in adamw}
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert muon_names | adamw_names == trained and not muon_names & adamw_names
    assert "fc.weight" in muon_names and "lm_head.weight" in adamw_names
    assert all(draft.get_parameter(n).ndim == 2 for n in muon_names)
    assert {n for n in adamw_names if n.endswith("norm.weight")} == {
        n for n in trained if n.endswith("norm.weight")}
    if kind == "peagle":
        assert "mask_hidden" in adamw_names  # a [1, N*H] vector
    theirs = speculators_module("train.optimizers").split_named_params_for_muon(draft)
    assert (muon_names, adamw_names) == tuple({n for n, _ in part} for part in theirs)


def test_a_muon_step_is_an_orthogonalised_update_and_adamws_is_not():
    """Muon's first update of a matrix is lr x an approximately orthogonal matrix (its singular
    values near 1: Newton-Schulz's quintic puts them in about [0.7, 1.2]); AdamW's first update
    (lr x the gradient's signs) is not."""
    train = TrainConfig(optimizer="muon", lr=1e-2, muon_weight_decay=0.0,
                        muon_adjust_lr="original", warmup_steps=1, steps=10)
    for name in ("muon", "adamw"):
        torch.manual_seed(0)
        draft = Eagle3Draft(CONFIG)
        optimizer = DraftOptimizer(draft, TrainConfig(**{**vars(train), "optimizer": name}))
        before = draft.fc.weight.detach().clone()
        draft.fc.weight.grad = torch.randn_like(before) * torch.rand(before.shape[0], 1) * 5
        optimizer.step()
        # fc is 32 x 96: Keller Jordan's adjustment sqrt(max(1, 32 / 96)) = 1.
        update = (before - draft.fc.weight.detach()) / 1e-2
        singular = torch.linalg.svdvals(update)
        spread = (float(singular.min()), float(singular.max()))
        if name == "muon":
            assert 0.6 < spread[0] and spread[1] < 1.3, spread
        else:
            assert spread[1] / spread[0] > 3, spread


def test_every_optimizer_follows_the_schedule_from_its_own_learning_rate():
    train = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=2e-2, warmup_steps=4, steps=20)
    optimizer = DraftOptimizer(Eagle3Draft(CONFIG), train)
    assert [type(p).__name__ for p in optimizer.parts] == ["Muon", "AdamW"]
    for _ in range(3):
        optimizer.advance_schedule()
    assert optimizer.scheduled_steps == 3
    lrs = [group["lr"] for part in optimizer.parts for group in part.param_groups]
    assert lrs == pytest.approx([2e-2, 1e-3]) and optimizer.lr == pytest.approx(1e-3)
    assert len(DraftOptimizer(Eagle3Draft(CONFIG), TrainConfig()).parts) == 1  # adamw


def continued(learner, steps: range) -> dict[str, torch.Tensor]:
    for step in steps:
        learner.step(tiny_batch(step))
    return {n: t.clone() for n, t in learner.draft.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resumed_learner_takes_the_steps_of_an_uninterrupted_one(tmp_path, optimizer):
    trained = tiny_learner(optimizer=optimizer)
    continued(trained, range(3))
    trained.save(tmp_path, 3)
    uninterrupted = continued(trained, range(3, 6))

    resumed = tiny_learner(optimizer=optimizer)  # the same target head, untrained
    assert resumed.resume(DirectoryCheckpoint(tmp_path), rank=0) == 3
    assert resumed.optimizer.scheduled_steps == 3
    after = continued(resumed, range(3, 6))
    assert all(torch.equal(after[n], uninterrupted[n]) for n in uninterrupted)
    # The control: the weights alone, the optimizer's state and schedule started afresh.
    fresh = tiny_learner(optimizer=optimizer)
    fresh.draft.load_state_dict(torch.load(tmp_path / CHECKPOINT_FILE)["draft"])
    other = continued(fresh, range(3, 6))
    assert not all(torch.equal(other[n], uninterrupted[n]) for n in uninterrupted)


def test_a_checkpoint_from_before_train_optimizer_resumes_its_adamw(tmp_path):
    trained = tiny_learner()
    continued(trained, range(2))
    adamw, schedule = trained.optimizer.parts[0], trained.optimizer.schedules[0]
    torch.save({"draft": trained.draft.state_dict(), "optimizer": adamw.state_dict(),
                "scheduler": schedule.state_dict(), "step": 2, "nonfinite_steps": 0},
               tmp_path / CHECKPOINT_FILE)  # the layout written before
    uninterrupted = continued(trained, range(2, 4))
    resumed = tiny_learner()
    assert resumed.resume(DirectoryCheckpoint(tmp_path), rank=0) == 2
    after = continued(resumed, range(2, 4))
    assert all(torch.equal(after[n], uninterrupted[n]) for n in uninterrupted)


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    trained = tiny_learner()
    continued(trained, range(1))
    trained.save(tmp_path, 1)
    with pytest.raises(ValueError, match="another train.optimizer"):
        tiny_learner(optimizer="muon").resume(DirectoryCheckpoint(tmp_path), rank=0)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_learner_trains_under_either_optimizer(optimizer):
    learner = tiny_learner(optimizer=optimizer, lr=1e-2, steps=12)
    losses = [float(learner.step(tiny_batch(0))["loss"]) for _ in range(8)]
    # Soft cross-entropy: the target's entropy (about 7.3 here) is its floor.
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[0] - losses[-1] > 0.2, losses
