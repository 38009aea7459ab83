"""Acceptance as published drafts are compared: the pooled figure and its bootstrap interval,
prompts read from MT-Bench / GSM8K / chat files and answered turn by turn, and settings an
evaluation cannot measure refused before any engine starts."""

import json
import math

import pytest
import ray

from eagle_ray.config import ConfigError, EvalConfig, JobConfig, from_dict
from eagle_ray.evaluation.acceptance import AcceptanceTally, answer_turn_by_turn, summarise
from eagle_ray.evaluation.evaluate import check_eval_settings
from eagle_ray.evaluation.prompts import EvalPrompt, read_eval_prompts
from eagle_ray.train.job import run_job


def tally(*histogram: int) -> AcceptanceTally:
    return AcceptanceTally(list(histogram))


def test_the_pooled_length_and_per_position_shares_come_from_the_histograms():
    # k = 3; one prompt accepted 0, 1 and 3 drafts in three steps, another 2 in one step.
    result = summarise([tally(1, 1, 0, 1), tally(0, 0, 1, 0)], k=3, bootstrap_samples=200)
    assert result["verify_steps"] == 4 and result["accepted_tokens"] == 6
    assert result["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    # Position j is accepted in steps that accepted more than j drafts.
    assert result["acceptance_per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    low, high = result["interval_95"]
    assert low <= result["mean_acceptance_length"] <= high


def test_the_interval_reflects_how_prompts_differ_and_how_many_there_are():
    alike = summarise([tally(2, 2, 2)] * 8, k=2)["interval_95"]
    assert alike[0] == alike[1], "prompts that agree leave nothing to resample"
    varied = [tally(9, 1, 0), tally(0, 1, 9), tally(5, 5, 0), tally(1, 2, 7)]
    few = summarise(varied, k=2)["interval_95"]
    many = summarise(varied * 16, k=2)["interval_95"]
    assert few[1] - few[0] > many[1] - many[0] > 0
    one = summarise([tally(1, 1, 1)], k=2)
    assert all(math.isnan(v) for v in one["interval_95"]), "no interval from one prompt"


def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n")
    return path


def test_prompt_files_of_every_shape_are_read_and_bad_lines_counted(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
        {"question": "Tom has 3 apples and buys 2. How many?", "answer": "5"},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Capital of Peru?"},
                      {"role": "assistant", "content": "Lima"}]},
        {"conversations": [{"from": "human", "value": "Name a colour."},
                           {"from": "gpt", "value": "Red."}]},
        "not json", {"turns": []}, {"messages": [{"role": "assistant", "content": "x"}]},
    ])
    read = read_eval_prompts(path)
    assert [p.turns for p in read.prompts] == [
        ("Write a haiku.", "Now a limerick."), ("Tom has 3 apples and buys 2. How many?",),
        ("Capital of Peru?",), ("Name a colour.",)]
    assert [m["content"] for m in read.prompts[2].context] == ["Be brief.", "Hi", "Hello"]
    assert sum(read.skipped.values()) == 3 and read.skipped["not JSON"] == 1
    assert len(read_eval_prompts(path, limit=2).prompts) == 2


def test_a_prompts_file_without_a_usable_prompt_is_refused(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ["nope", {"answer": "5"}])
    with pytest.raises(ConfigError, match="no usable evaluation prompt.*turns.*question"):
        read_eval_prompts(path)


def test_turns_are_answered_in_order_each_answer_joining_the_next_turn(family_tokenizers):
    tokenizer = family_tokenizers["kit"]
    prompts = [EvalPrompt((), ("What is one plus two?", "And plus three?")),
               EvalPrompt((), ("What is the capital of Peru?",)),
               EvalPrompt((), ("word " * 300,))]  # longer than the room given below
    calls = []

    def answer(owners, batch):
        calls.append(list(owners))
        return [tokenizer.encode(f"answer {i}", add_special_tokens=False) for i in owners]

    sent, failed = answer_turn_by_turn(prompts, tokenizer, answer, max_prompt_tokens=200)
    assert calls == [[0, 1], [0]], "turn 1 of every prompt in one batch, then turn 2"
    assert list(failed) == [2]
    assert "more than the 200" in failed[2] and "eval.max_new_tokens" in failed[2]
    second_turn = tokenizer.decode(sent[0][1])
    assert "What is one plus two?" in second_turn and "answer 0" in second_turn
    assert "And plus three?" in second_turn and len(sent[1]) == 1 and sent[2] == []


@pytest.mark.parametrize(("setting", "ttt_steps", "message"), [
    ({"num_speculative_tokens": [3, 9]}, 7, r"has 9.*train.ttt_steps=7"),
    ({"num_speculative_tokens": [0]}, 7, "at least 1"),
    ({"temperatures": [0.0, -0.5]}, 7, "temperature is 0"),
    ({"prompts": 0}, 7, "at least one prompt"),
])
def test_settings_an_evaluation_cannot_measure_are_refused(setting, ttt_steps, message):
    with pytest.raises(ConfigError, match=message):
        check_eval_settings(from_dict(EvalConfig, setting), ttt_steps)
    check_eval_settings(EvalConfig(), 7)  # control: the defaults pass


def test_a_job_whose_evaluation_cannot_run_stops_before_anything_starts(tmp_path):
    config = from_dict(JobConfig, {"eval": {"num_speculative_tokens": [3, 7]},
                                   "train": {"ttt_steps": 3},
                                   "output_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="raise train.ttt_steps"):
        run_job(config)
    assert not ray.is_initialized() and not (tmp_path / "run").exists()
