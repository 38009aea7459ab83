"""The evaluation's greedy reference and its simulation's target: the reference is vLLM serving the
target exactly as the draft is served, without the draft (one engine at a time), and the simulation
reads the pool's own backend (vLLM at the pool's tensor-parallel size by default) as it reads HF.
"""

import types

import pytest
import torch
from transformers import AutoTokenizer

from eagle_ray.backends.base import Sampling
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.backends.vllm import runner
from eagle_ray.config import EvalConfig, PoolConfig
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.chat import prompt_for_turn, stop_token_ids
from eagle_ray.draft.export import export_draft
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.evaluate import evaluate_draft
from eagle_ray.evaluation.prompts import EvalPrompt, EvalPrompts
from eagle_ray.evaluation.simulate import simulation_target, target_states
from eagle_ray.tiny import tiny_target

SPECULATION_KEYS = {"speculative_config", "per_request_spec_decode_metrics",
                    "worker_extension_cls"}
PROMPTS = [EvalPrompt((), ("What is one plus two?", "And plus three?")),
           EvalPrompt((), ("What is the capital of Peru?",)),
           EvalPrompt((), ("Name a colour.",))]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the pre-trained tiny Llama in fp32, its path, a draft exported for it)."""
    path = tiny_target("llama", pretrained=True)
    target = HFEagle3TargetModel.from_pretrained(path, dtype=torch.float32)
    vocab = DraftVocab.from_token_counts(torch.arange(target.vocab_size) % 5 + 1, 128)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(target.model.config, vocab.size),
                        target.get_input_embeddings().weight.detach())
    draft_dir = export_draft(draft, vocab, TargetIdentity.of_backend(target, str(path)),
                             tmp_path_factory.mktemp("eval") / "draft", ttt_steps=3)
    return target, str(path), str(draft_dir)


class FakeEngines:
    """`runner.build_llm` recording each engine's kwargs, answering greedily with `reference`
    (an engine without a speculative config) or `speculative` (with one), and noting which
    engines were alive when each was built. A speculative engine's workers count
    `forwards_per_step` draft forwards per generate call (`draft_forwards`' worker methods)."""

    def __init__(self, reference, speculative, forwards_per_step: int = 2) -> None:
        self.answerers = {"reference": reference, "speculative": speculative}
        self.forwards_per_step = forwards_per_step
        self.built: list[tuple[str, dict]] = []
        self.alive_at_build: list[int] = []
        self.prompts: dict[str, list[list[list[int]]]] = {"reference": [], "speculative": []}
        self.alive = 0

    def build_llm(self, kwargs, multiprocess, env=None):
        kind = "speculative" if "speculative_config" in kwargs else "reference"
        self.built.append((kind, kwargs))
        self.alive_at_build.append(self.alive)
        self.alive += 1
        return types.SimpleNamespace(
            generate=lambda prompts, params, use_tqdm: self._generate(kind, prompts, params),
            collective_rpc=self._collective_rpc,
            llm_engine=types.SimpleNamespace(
                model_config=types.SimpleNamespace(max_model_len=kwargs["max_model_len"]),
                engine_core=types.SimpleNamespace(shutdown=self._shutdown)))

    def _generate(self, kind, prompts, params):
        batch = [p["prompt_token_ids"] for p in prompts]
        self.prompts[kind].append(batch)
        answers = self.answerers[kind].complete(batch, Sampling(
            params.max_tokens, params.temperature, stop_token_ids=tuple(params.stop_token_ids)))
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
            token_ids=a, spec_decode_metrics=None)]) for a in answers]

    def _collective_rpc(self, method):
        steps = len(self.prompts["speculative"])
        return [{"eagle_ray_count_draft_forwards": True,
                 "eagle_ray_draft_forwards": {"rank": 0, "proposals": steps, "requests": steps,
                                              "forwards": self.forwards_per_step * steps}
                 }[method]]

    def _shutdown(self):
        self.alive -= 1


def evaluate_with(engines: FakeEngines, served, monkeypatch, **settings):
    """The evaluation at k = 2, greedy unless `settings` say otherwise, with `engines` standing
    in for vLLM, the served engines at tensor-parallel size 2, the simulation on the HF
    backend."""
    _, path, draft_dir = served
    monkeypatch.setattr(runner, "build_llm", engines.build_llm)
    pool = PoolConfig(backend="hf", model_path=path, dtype="float32")
    serving = DraftServing(path, draft_dir, "float32", tp_size=2)
    config = EvalConfig(**{"prompts": 3, "max_new_tokens": 8, "num_speculative_tokens": [2],
                           "temperatures": [0.0], "bootstrap_samples": 10, **settings})
    return evaluate_draft(pool, serving, EvalPrompts(PROMPTS, {}), config)


def test_the_reference_is_the_served_engine_without_the_draft(served, monkeypatch):
    """The reference engine is built first, with the served engine's kwargs (tp_size 2 and its
    executor, dtype, max_model_len, seed) less the speculative config, and shut down before the
    serving engine starts; it answers each turn's prompts in one batch, the very prompts the
    served engine answers; speculation that changes nothing keeps every greedy answer."""
    target = served[0]
    engines = FakeEngines(reference=target, speculative=target)
    report = evaluate_with(engines, served, monkeypatch)

    assert [kind for kind, _ in engines.built] == ["reference", "speculative"]
    (_, reference), (_, speculative) = engines.built
    assert reference == {k: v for k, v in speculative.items() if k not in SPECULATION_KEYS}
    assert reference["tensor_parallel_size"] == 2 and "distributed_executor_backend" in reference
    assert speculative["speculative_config"]["num_speculative_tokens"] == 2
    assert engines.alive_at_build == [0, 0] and engines.alive == 0, "one engine at a time"
    assert [len(batch) for batch in engines.prompts["reference"]] == [3, 1], "a batch per turn"
    assert engines.prompts["speculative"] == engines.prompts["reference"]
    assert report["turns"] == 4 and report["failed_prompts"] == 0
    assert report["vllm"][0]["greedy_equal_fraction"] == 1.0
    assert report["draft"]["forwards_per_verify_step"] == {"2": 2.0}  # the engine's count
    assert report["draft"]["drafts_as_its_kind"] is True


def test_the_draft_forwards_reported_are_those_the_engine_counted(served, monkeypatch):
    """The summary's forwards per verify step are what the serving engine's workers counted,
    not what the draft's kind says: an engine that ran one pass per step for an EAGLE-3 chain
    at k = 2 is reported as one, and flagged (an engine that ran 2 is not: the first test; each
    kind on a real engine: tests/train/test_train.py)."""
    engines = FakeEngines(reference=served[0], speculative=served[0], forwards_per_step=1)
    draft = evaluate_with(engines, served, monkeypatch)["draft"]
    assert draft["kind"] == "eagle3"
    assert draft["forwards_per_verify_step"] == {"2": 1.0}
    assert draft["drafts_as_its_kind"] is False


def test_sampled_each_prompt_is_answered_samples_per_prompt_times_and_replayed(served,
                                                                              monkeypatch):
    """At temperature 1 the serving engine answers every prompt `eval.samples_per_prompt` times
    (each copy its own conversation: a turn's batch holds every prompt's copies; greedily, once:
    the first test); the row pools a prompt's answers (the interval resamples the 3 prompts),
    and the simulation replays every sampled answer, the second turn's too
    (`eagle_ray.evaluation.paired`)."""
    engines = FakeEngines(reference=served[0], speculative=served[0])
    report = evaluate_with(engines, served, monkeypatch, temperatures=[1.0],
                           samples_per_prompt=3)
    assert [len(batch) for batch in engines.prompts["speculative"]] == [9, 3]
    [row] = report["vllm"]
    assert row["answers_per_prompt"] == 3 and row["prompts"] == 3
    [simulated] = report["simulated"]
    assert simulated["trained_on_vllm_answers"]["answers"] == 12
    assert simulated["trained_on_vllm_answers"]["verify_steps"] > 0


def test_a_reference_from_another_model_fails_the_greedy_check(served, monkeypatch, hf_llama):
    """The control: the same evaluation whose reference engine answers as another model (the
    tiny Llama before pre-training) finds the served answers changed."""
    engines = FakeEngines(reference=hf_llama, speculative=served[0])
    report = evaluate_with(engines, served, monkeypatch)
    assert report["vllm"][0]["greedy_equal_fraction"] < 0.5


@pytest.mark.slow
def test_the_simulation_reads_the_pools_vllm_backend_as_it_reads_hf(served):
    """On the pool's default backend (vLLM, the draft's aux layers, sized for the evaluation's
    longest sequence, in its own processes) the states the simulation reads equal the HF
    reference's at every position; the control: the states one token later differ far beyond
    the tolerance."""
    target, path, draft_dir = served
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = prompt_for_turn(tokenizer, [{"role": "user", "content": "Name a colour."}], 1)
    ids += [stop_token_ids(tokenizer)[0]] + ids  # a second turn's length
    with simulation_target(PoolConfig(model_path=path, dtype="float32"),
                           DraftServing(path, draft_dir, "float32"), 200) as backend:
        assert backend.aux_layer_ids == target.aux_layer_ids and backend.max_length == 200
        # In processes of its own: its memory is back before the serving engines start.
        assert backend.runner.multiprocess
        vllm_aux, vllm_last = target_states(backend, ids)
    hf_aux, hf_last = target_states(target, ids)
    assert vllm_aux.shape == hf_aux.shape and vllm_last.shape == hf_last.shape
    assert torch.allclose(vllm_aux, hf_aux, atol=1e-4)
    assert torch.allclose(vllm_last, hf_last, atol=1e-4)
    later_aux, later_last = target_states(target, ids[1:] + ids[:1])
    assert (later_aux - hf_aux).abs().max() > 0.1 and (later_last - hf_last).abs().max() > 0.1
