"""`eagle_ray.data.regenerate`: answers come from the target (its own greedy answers, turn by turn),
the dataset keeps its shape, a killed replica loses and duplicates nothing, an interrupted run
resumes without redoing what it finished. Also: the pre-trained tiny target answers like its
corpus."""

import json
import re
import threading

import pytest
import ray
import torch
from transformers import AutoTokenizer

from eagle_ray.backends.base import Sampling
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.data.chat import conversation_messages, prompt_for_turn, stop_token_ids
from eagle_ray.data.regenerate import META_KEY, regenerate_file
from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
from eagle_ray.testing import synthetic_answer
from eagle_ray.tiny import generate_chat_samples, tiny_target

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    running_ray,
    synthetic_pool,
    wait_until,
)

pytestmark = pytest.mark.slow

SAMPLING = Sampling(max_new_tokens=40)


@pytest.fixture(scope="module")
def pretrained():
    return tiny_target("llama", pretrained=True)


@pytest.fixture(scope="module")
def local_ray():
    with running_ray(namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH):
        yield


@pytest.fixture(scope="module")
def vllm_pool(local_ray, pretrained):
    pool = TargetPool.create(PoolConfig(model_path=str(pretrained), dtype="float32",
                                        name="regen", namespace="eagle_ray_test"))
    yield pool
    pool.shutdown()


def write_source(path, count: int, seed: int = 21):
    """Two-turn conversations whose answers the target would not give; half in ShareGPT shape."""
    samples = generate_chat_samples(2 * count, seed=seed)
    with open(path, "w") as f:
        for i in range(count):
            first, second = samples[2 * i]["messages"], samples[2 * i + 1]["messages"]
            messages = [first[0], first[1], {"role": "assistant", "content": "I do not know."},
                        second[1], {"role": "assistant", "content": "Ask me later."}]
            if i % 2:
                line = {"conversations": [{"from": {"system": "system", "user": "human",
                                                    "assistant": "gpt"}[m["role"]],
                                           "value": m["content"]} for m in messages]}
            else:
                line = {"messages": messages}
            f.write(json.dumps(line) + "\n")
    return path


def read_output(path):
    return [json.loads(line) for line in open(path)]


def test_answers_are_the_targets_greedy_answers_turn_by_turn(vllm_pool, pretrained, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    source = write_source(tmp_path / "source.jsonl", 6)
    report = regenerate_file(vllm_pool.client(), tokenizer, source, tmp_path / "out.jsonl",
                             SAMPLING, fingerprint="fp", progress=False)
    assert (report.conversations, report.answers, report.failed) == (6, 12, 0)
    output = read_output(tmp_path / "out.jsonl")
    reference = HFEagle3TargetModel.from_pretrained(pretrained, dtype=torch.float32)
    stops = stop_token_ids(tokenizer)
    for line_no, (line, original) in enumerate(zip(output, read_output(source), strict=True), 1):
        assert set(line) - {META_KEY} == set(original), "the dataset keeps its shape"
        assert line[META_KEY]["source_line"] == line_no and line[META_KEY]["target"] == "fp"
        assert line[META_KEY]["changed"] and line[META_KEY]["sampling"]["temperature"] == 0.0
        messages = conversation_messages(line, "output")
        for turn in (2, 4):  # each answer conditions on the regenerated history before it
            prompt = prompt_for_turn(tokenizer, messages, turn)
            greedy = reference.complete([prompt], Sampling(max_new_tokens=40,
                                                           stop_token_ids=stops))[0]
            assert messages[turn]["content"] == tokenizer.decode(
                greedy[:-1] if greedy[-1] in stops else greedy, skip_special_tokens=True)
    assert report.changed_share == 1.0


def test_an_interrupted_run_resumes_without_redoing_finished_ones(vllm_pool, pretrained,
                                                                  tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    source = write_source(tmp_path / "source.jsonl", 6, seed=22)
    output = tmp_path / "out.jsonl"
    regenerate_file(vllm_pool.client(), tokenizer, source, output, SAMPLING, progress=False)
    complete = output.read_text().splitlines()
    # As if killed while writing the third line: two finished, one torn.
    output.write_text(complete[0] + "\n" + complete[1] + "\n" + complete[2][:40])
    report = regenerate_file(vllm_pool.client(), tokenizer, source, output, SAMPLING,
                             progress=False)
    assert (report.resumed, report.conversations, report.answers) == (2, 4, 8)
    assert report.changed_share == 1.0, "resumed conversations count in the changed share"
    lines = output.read_text().splitlines()
    assert sorted(json.loads(line)[META_KEY]["source_line"] for line in lines) == [1, 2, 3, 4,
                                                                                   5, 6]
    assert sorted(lines) == sorted(complete), "the resumed run writes what a whole run wrote"


def test_a_killed_replica_loses_and_duplicates_no_conversation(local_ray, pretrained, tmp_path):
    gate = tmp_path / "hold"
    gate.touch()
    pool = synthetic_pool("regen-kill", backend_kwargs={
        "vocab_size": 4096, "hold_while": str(gate), "hold_first_call_only": True})
    try:
        tokenizer = AutoTokenizer.from_pretrained(pretrained)
        source = write_source(tmp_path / "source.jsonl", 20, seed=23)
        client = pool.client(ClientConfig(max_inflight_micro_batches=16))
        reports = []
        running = threading.Thread(target=lambda: reports.append(regenerate_file(
            client, tokenizer, source, tmp_path / "out.jsonl", SAMPLING,
            prompts_per_request=2, progress=False)))
        running.start()
        # The first turn of 20 conversations is 10 requests (the second turns wait for the whole
        # first wave): all leased, the first held on its replica (with any queued behind it),
        # every other one served.
        def first_wave_settled() -> bool:
            replicas = pool.status()["replicas"].values()
            busy = [r for r in replicas if r["outstanding_micro_batches"]]
            return len(busy) == 1 and sum(r["served_micro_batches"] + r[
                "outstanding_micro_batches"] for r in replicas) == 10

        wait_until(first_wave_settled, what="one request held, the others served")
        held = next(name for name, r in pool.status()["replicas"].items()
                    if r["outstanding_micro_batches"])
        ray.kill(ray.get_actor(held, namespace="eagle_ray_test"), no_restart=False)
        # The gate opens only once the kill has landed (the held request re-run): opened
        # before, the held call could finish first.
        wait_until(lambda: client.stats.retries >= 1, what="the held request re-run")
        gate.unlink()
        running.join(TIMEOUT_S)
        assert reports and reports[0].conversations == 20 and reports[0].failed == 0
        assert client.stats.retries >= 1, "the killed replica's request was re-run"
        output = read_output(tmp_path / "out.jsonl")
        assert sorted(line[META_KEY]["source_line"] for line in output) == list(range(1, 21))
        stops = stop_token_ids(tokenizer)
        for line in output:
            messages = conversation_messages(line, "output")
            prompt = prompt_for_turn(tokenizer, messages, 2)
            expected = synthetic_answer(prompt, Sampling(max_new_tokens=40,
                                                         stop_token_ids=stops))
            assert messages[2]["content"] == tokenizer.decode(expected[:-1],
                                                              skip_special_tokens=True)
    finally:
        pool.shutdown()


OPENING = r"(?:(?:Well|Simply put), |Sure: )?"
CORPUS_PHRASINGS = [  # every phrasing the kit's corpus uses, the facts left open
    OPENING + r"(?:[Tt]he capital (?:city )?of [\w ]+ is [\w ]+|[Ii]n [\w ]+, the capital is "
    r"[\w ]+|[\w ]+ has [\w ]+ as its capital)(?:, (?:a busy city|an old city|by the way))?\.",
    OPENING + r"(?:\w+ plus \w+ (?:is|equals) \w+|\w+ and \w+ make \w+|[Aa]dding \w+ and \w+ "
    r"gives \w+)(?:, (?:I think|as always|of course))?\.",
    OPENING + r"[Tt]he \w+ \w+ (?:looks|seems|is|feels) \w+ and \w+\."]


def the_facts(question: str) -> list[str]:
    """What any right answer to a kit question names: the capital, the sum, the colour and
    the thing."""
    from eagle_ray.tiny import _COUNTRIES, _NUMBERS

    if match := re.fullmatch(r"What is the capital of (.+)\?", question):
        return [_COUNTRIES[match[1]]]
    if match := re.fullmatch(r"What is (\w+) plus (\w+)\?", question):
        return [_NUMBERS[_NUMBERS.index(match[1]) + _NUMBERS.index(match[2])]]
    return list(re.fullmatch(r"Describe a (\w+) (\w+) in one sentence\.", question).groups())


def test_the_pretrained_tiny_target_answers_held_out_prompts_like_its_corpus(pretrained):
    """Its greedy answers use the corpus's phrasings and get the facts right, and it is unsure
    of the phrasing: its mean top probability along them is inside the band the kit promises
    (docs/training.md), so sampling at temperature 1 differs from greedy."""
    from eagle_ray.evaluation.simulate import target_top_probability

    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    target = HFEagle3TargetModel.from_pretrained(pretrained, dtype=torch.float32)
    stops = stop_token_ids(tokenizer)
    held_out = generate_chat_samples(50, seed=77)  # prompts it was not pre-trained on
    prompts, answers, right, matching = [], [], 0, 0
    for sample in held_out:
        prompts.append(prompt_for_turn(tokenizer, sample["messages"], 2))
        answers.append(target.complete([prompts[-1]], Sampling(max_new_tokens=40,
                                                               stop_token_ids=stops))[0])
        answer = tokenizer.decode(answers[-1][:-1] if answers[-1][-1] in stops else answers[-1])
        matching += any(re.fullmatch(p, answer) for p in CORPUS_PHRASINGS)
        right += all(fact in answer for fact in the_facts(sample["messages"][1]["content"]))
    # Measured: 50 of 50 in the corpus's phrasing, 50 of 50 right, top probability 0.80.
    assert matching >= 45 and right >= 45, (matching, right)
    confidence = target_top_probability(target, prompts, answers)
    assert 0.6 <= confidence <= 0.85, confidence
