"""The draft forwards per verify step, counted inside vLLM's engine
(eagle_ray/backends/vllm/draft_forwards.py): the counter counts the draft module's calls made
inside a proposal, whatever vLLM wraps the module in, read back once across tensor-parallel
ranks; and the evaluation catches a draft that runs other than its kind drafts. Each kind's
figure on a real engine: tests/train/test_train.py (EAGLE-3 3 and 7, P-EAGLE and DFlash 1)."""

import logging
import types

import pytest
import torch
from kit_helpers import perturbed_kind_draft
from torch import nn

from eagle_ray.backends.vllm import draft_forwards
from eagle_ray.backends.vllm.draft_forwards import DraftForwards, count_draft_forwards
from eagle_ray.evaluation.evaluate import measured_draft_forwards


class Drafter:
    """A V1 proposer's shape: `propose` runs its `model` `passes` times for a batch of
    `requests` and returns their k draft ids; `dummy_run` (profiling) runs it outside."""

    def __init__(self) -> None:
        self.model = nn.Linear(4, 4)

    def propose(self, passes: int, requests: int, k: int = 3) -> torch.Tensor:
        for _ in range(passes):
            self.model(torch.zeros(requests, 4))
        return torch.zeros(requests, k, dtype=torch.long)

    def dummy_run(self) -> None:
        self.model(torch.zeros(1, 4))


class GraphWrapper:
    """What vLLM puts in the drafter's `model` for CUDA graphs: called once per forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args):
        return self.module(*args)


def test_a_proposal_counts_the_draft_modules_calls_inside_it_and_only_those():
    drafter = Drafter()
    assert count_draft_forwards(drafter) and count_draft_forwards(drafter), "idempotent"
    drafter.dummy_run()
    drafter.propose(passes=3, requests=2)
    drafter.propose(passes=1, requests=5)
    drafter.dummy_run()
    counts = getattr(drafter, draft_forwards.COUNTER)
    assert counts == DraftForwards(proposals=2, forwards=4, requests=7)
    assert counts.per_verify_step() == 2.0
    # vLLM wraps the module after loading it (CUDA graphs): the wrapper's calls are counted.
    drafter.model = GraphWrapper(drafter.model)
    drafter.propose(passes=3, requests=1)
    assert counts == DraftForwards(proposals=3, forwards=7, requests=8)
    assert isinstance(drafter.model, GraphWrapper), "what vLLM checks still holds"


def test_without_a_v1_drafter_nothing_is_counted():
    """vLLM's V2 model runner has no `drafter`: not measured, rather than a made-up figure."""
    assert not count_draft_forwards(None)
    assert not count_draft_forwards(types.SimpleNamespace(propose=lambda: None))


def engine_answering(*replies):
    return types.SimpleNamespace(collective_rpc=lambda method: [r and dict(r) for r in replies])


def test_tensor_parallel_ranks_are_counted_once_and_a_disagreeing_rank_is_logged(caplog):
    one = {"proposals": 4, "forwards": 12, "requests": 8}
    assert draft_forwards.read(engine_answering({"rank": 1, **one}, {"rank": 0, **one})) == (
        DraftForwards(4, 12, 8))  # rank 0's, not the sum
    with caplog.at_level(logging.WARNING):
        counts = draft_forwards.read(engine_answering({"rank": 0, **one},
                                                      {"rank": 1, **one, "forwards": 4}))
    assert counts == DraftForwards(4, 12, 8) and "rank 1 counted" in caplog.text
    assert draft_forwards.read(engine_answering(None)) is None


def rows(k: int, *counts: DraftForwards) -> list[dict]:
    return [{"num_speculative_tokens": k, "temperature": t, "draft_forwards": vars(c)}
            for t, c in enumerate(counts)]


def test_the_evaluation_pools_temperatures_and_catches_a_draft_run_against_its_kind(caplog):
    """A chain runs k forwards per verify step, a parallel draft one; the control: the same
    counts for a kind that claims parallel drafting are flagged (a P-EAGLE draft served without
    `parallel_drafting` runs as a chain)."""
    chain = rows(3, DraftForwards(10, 30, 20), DraftForwards(6, 18, 12))
    assert measured_draft_forwards(chain, [3], "eagle3") == {
        "forwards_per_verify_step": {"3": 3.0}, "drafts_as_its_kind": True}
    with caplog.at_level(logging.WARNING):
        assert measured_draft_forwards(chain, [3], "peagle")["drafts_as_its_kind"] is False
    assert "where a peagle draft runs one" in caplog.text
    block = rows(3, DraftForwards(10, 10, 20))
    assert measured_draft_forwards(block, [3], "dflash")["drafts_as_its_kind"] is True
    assert measured_draft_forwards(block, [3], "eagle3")["drafts_as_its_kind"] is False
    assert measured_draft_forwards([], [3, 7], "eagle3") == {
        "forwards_per_verify_step": {"3": None, "7": None}, "drafts_as_its_kind": None}


@pytest.mark.slow
def test_a_peagle_draft_served_without_parallel_drafting_runs_k_forwards_and_is_caught(
        tmp_path):
    """The control on a real engine (its process, not this one): vLLM serves a P-EAGLE export
    whose speculative config lacks `parallel_drafting` as a chain, k forwards per verify step,
    and the evaluation flags it; every verify step vLLM counted came from a counted proposal
    (one more per request: its last drafts are never verified)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.backends.vllm.runner import serving_engine
    from eagle_ray.contract.identity import TargetIdentity
    from eagle_ray.draft.export import export_draft
    from eagle_ray.draft.serving import DraftServing
    from eagle_ray.tiny import tiny_target

    path = tiny_target("llama", pretrained=True)
    target = HFEagle3TargetModel.from_pretrained(path, dtype=torch.float32)
    vocab, _, draft = perturbed_kind_draft(target, "peagle", num_layers=1)
    folder = export_draft(draft, vocab, TargetIdentity.of_backend(target, str(path)),
                          tmp_path / "draft", ttt_steps=3)
    serving = DraftServing.for_target(str(path), folder, "float32")
    kwargs = serving.engine_kwargs(3)
    assert kwargs["speculative_config"].pop("parallel_drafting") is True  # the misconfiguration
    prompts = [TokensPrompt(prompt_token_ids=list(range(5 + i, 25 + i))) for i in range(3)]
    with serving_engine({**kwargs, "max_model_len": 128, "per_request_spec_decode_metrics":
                         "summary", "worker_extension_cls": draft_forwards.EXTENSION}) as llm:
        assert draft_forwards.start_counting(llm)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                       detokenize=False), use_tqdm=False)
        counts = draft_forwards.read(llm)
    verify_steps = sum(sum(o.outputs[0].spec_decode_metrics.histogram) for o in outputs)
    assert counts.per_verify_step() == 3.0 and counts.proposals > 1
    assert verify_steps < counts.requests <= verify_steps + len(prompts)
    row = {"num_speculative_tokens": 3, "draft_forwards": vars(counts)}
    assert measured_draft_forwards([row], [3], "peagle")["drafts_as_its_kind"] is False
