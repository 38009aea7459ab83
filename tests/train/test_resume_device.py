"""Resuming a checkpoint puts its tensors on the resuming learner's device, not on the GPU rank 0
saved them from: a node's Ray Train workers all see that GPU, and eight copies of the draft and
AdamW's state there (~7 GiB each at the 8B recipe) exhaust it on the very restart that
`train.max_failures` exists for."""

import pytest
import ray.train
import torch

from eagle_ray.train.loop import CHECKPOINT_FILE, DraftLearner

from learner_helpers import tiny_batch as batch
from learner_helpers import tiny_learner as learner

# Rank 0's GPU as a checkpoint records it: an index no machine here has, so a load that keeps
# the recorded device fails on a CPU-only and a GPU machine alike.
SAVED_ON = "cuda:99"


def save_as_if_on_a_gpu(trained: DraftLearner, directory, step: int, monkeypatch) -> None:
    """`DraftLearner.save` with every storage recorded as on `SAVED_ON` (torch.save's
    location tag: what rank 0 on a GPU writes); loading is left as it is."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "_package_registry",
                      list(torch.serialization._package_registry))
        torch.serialization.register_package(-1, lambda storage: SAVED_ON,
                                             lambda storage, location: None)
        trained.save(directory, step)


def tensors(state) -> list[torch.Tensor]:
    """Every tensor in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors(value)]
    if isinstance(state, list | tuple):
        return [t for value in state for t in tensors(value)]
    return []


def test_a_resumed_learner_holds_the_checkpoint_on_its_own_device(tmp_path, monkeypatch):
    trained = learner(seed=0)
    for _ in range(2):
        trained.step(batch())  # AdamW's moments exist from the first step
    save_as_if_on_a_gpu(trained, tmp_path, 2, monkeypatch)
    # Control: read as saved, the checkpoint's tensors go to rank 0's GPU.
    with pytest.raises(RuntimeError, match="CUDA device"):
        torch.load(tmp_path / CHECKPOINT_FILE, weights_only=False)

    asked = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: asked.append(kw) or load(*a, **kw))
    resumed = learner(seed=1)
    assert resumed.resume(ray.train.Checkpoint.from_directory(tmp_path), rank=3) == 2
    assert [torch.device(kw["map_location"]) for kw in asked] == [torch.device("cpu")]

    state = {"draft": resumed.draft.state_dict(), "optimizer": resumed.optimizer.state_dict()}
    moments = [t for part in resumed.optimizer.parts for s in part.state.values()
               for n, t in s.items() if n != "step"]
    assert moments and {t.device for t in tensors(state)} == {resumed.device}
    for name, value in trained.draft.state_dict().items():
        assert torch.equal(state["draft"][name], value), name
    assert resumed.optimizer.scheduled_steps == trained.optimizer.scheduled_steps == 2
