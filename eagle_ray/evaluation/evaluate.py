"""Acceptance length of a draft against its target, measured two independent ways, where the
target's GPUs are (a Ray task: `evaluate_on_cluster`).

1. vLLM itself serving the exported draft as the target's `eagle3` speculative model, at each
   `eval.num_speculative_tokens` k and `eval.temperatures` temperature, with intervals
   (`eagle_ray.evaluation.acceptance`); at temperature 0 its output must equal the target's
   greedy output without speculation.
2. The project's own chain-drafting simulation with the HF target (`eagle_ray.evaluation.simulate`)
   on the same turns, at the same k and temperatures, for the trained draft and an untrained one
   (the baseline): independent of vLLM's speculative decoding, so each checks the other (at
   temperature 0 they agree exactly).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle_ray.backends.base import Sampling
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.config import ConfigError, EvalConfig, PoolConfig
from eagle_ray.data.chat import stop_token_ids
from eagle_ray.draft.export import load_exported_draft
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.acceptance import answer_turn_by_turn, vllm_acceptance_table
from eagle_ray.evaluation.prompts import EvalPrompt, EvalPrompts, read_eval_prompts
from eagle_ray.evaluation.simulate import (
    draft_seconds_per_verify_step,
    simulate_acceptance,
    simulate_sampled,
    target_top_probability,
)

logger = logging.getLogger(__name__)


def greedy_generate(target: HFEagle3TargetModel, prompt: list[int], max_new_tokens: int,
                    stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """The target's greedy continuation of `prompt`, up to and including a stop token."""
    return target.complete([prompt], Sampling(max_new_tokens=max_new_tokens,
                                              stop_token_ids=stop_token_ids))[0]


def check_eval_settings(eval_config: EvalConfig, ttt_steps: int | None,
                        where: str = "train.ttt_steps") -> None:
    """Refuse, before any engine starts, what an evaluation cannot measure."""
    for k in eval_config.num_speculative_tokens:
        if k < 1:
            raise ConfigError(f"eval.num_speculative_tokens has {k}; each k drafts at least 1 "
                              f"token")
        if ttt_steps is not None and k > ttt_steps:
            raise ConfigError(f"eval.num_speculative_tokens has {k}, more draft tokens than the "
                              f"draft was trained to chain ({where}={ttt_steps}): raise "
                              f"train.ttt_steps, or evaluate k <= {ttt_steps}")
    if not eval_config.num_speculative_tokens or not eval_config.temperatures:
        raise ConfigError("eval.num_speculative_tokens and eval.temperatures need a value each")
    if any(t < 0 for t in eval_config.temperatures):
        raise ConfigError(f"eval.temperatures {eval_config.temperatures}: a temperature is 0 "
                          f"(greedy) or more")
    if eval_config.prompts < 1:
        raise ConfigError(f"eval.prompts={eval_config.prompts}: evaluate at least one prompt")


def evaluation_prompts(eval_config: EvalConfig,
                       held_out: Sequence[list[dict[str, str]]] = ()) -> EvalPrompts:
    """`eval.prompts_file`'s prompts, else the held-out conversations' (first `eval.prompts`)."""
    if eval_config.prompts_file:
        return read_eval_prompts(eval_config.prompts_file, eval_config.prompts)
    prompts = [EvalPrompt.from_conversation(m) for m in held_out[:eval_config.prompts]]
    if not prompts:
        raise ConfigError("evaluation needs prompts: set eval.prompts_file, or hold some "
                          "conversations out (data.eval_samples > 0)")
    return EvalPrompts(prompts, {})


class GreedyAnswers:
    """The target's greedy answer (HF, no speculation) to each prompt, computed once: the
    simulation's continuation and the reference vLLM's greedy output must equal. Once
    `release`d (the HF model freed for vLLM's engine), an answer not computed before is None."""

    def __init__(self, target: HFEagle3TargetModel, max_new_tokens: int,
                 stop_token_ids: tuple[int, ...]) -> None:
        self.target, self.max_new_tokens, self.stops = target, max_new_tokens, stop_token_ids
        self._answers: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, owners: list[int], batch: list[list[int]]) -> list[list[int] | None]:
        for ids in batch:
            if tuple(ids) not in self._answers and self.target is not None:
                self._answers[tuple(ids)] = greedy_generate(self.target, ids,
                                                            self.max_new_tokens, self.stops)
        return [self._answers.get(tuple(ids)) for ids in batch]

    def release(self) -> None:
        """Drop the HF model (its memory goes back to the device)."""
        self.target = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def evaluate_draft(serving: DraftServing, prompts: EvalPrompts, eval_config: EvalConfig
                   ) -> dict[str, Any]:
    """Acceptance of the exported draft: the project's own simulation of the trained and of an
    untrained draft with the HF target first, then vLLM serving the draft at every k and
    temperature of `eval_config` as `serving.command(k)` does (`eagle_ray.evaluation.acceptance`),
    on the same turns; on the target the draft was exported for (its aux layer ids), in the target's
    dtype, on a GPU where this process has one. Runs where it is called: a job runs it as a Ray
    task with the target's resources (`evaluate_on_cluster`)."""
    from eagle_ray.data.tokenizer_files import load_tokenizer
    from eagle_ray.draft.export import exported_ttt_steps

    check_eval_settings(eval_config, exported_ttt_steps(serving.draft_dir),
                        f"the draft's {Path(serving.draft_dir) / 'config.json'} "
                        f"eagle_ray_ttt_steps")
    _, tokenizer = load_tokenizer(serving.model_path, {"tokenizer": serving.tokenizer}
                                  if serving.tokenizer else {}, "the evaluation")
    stops = stop_token_ids(tokenizer)  # answers end at the chat's end-of-turn token
    report, greedy = _simulate(serving, prompts, tokenizer, eval_config, stops)
    greedy.release()  # vLLM's engine gets the device to itself
    if eval_config.vllm:
        report["vllm"] = vllm_acceptance_table(
            serving, prompts.prompts, tokenizer, eval_config.num_speculative_tokens,
            eval_config.temperatures, eval_config.max_new_tokens, stops, reference=greedy,
            bootstrap_samples=eval_config.bootstrap_samples, seed=eval_config.seed)
    logger.info("evaluation on %d prompts (%d turns): %s", len(prompts.prompts),
                report["turns"], "; ".join(
                    f"k={r['num_speculative_tokens']} t={r['temperature']:g} "
                    f"{r['mean_acceptance_length']:.2f}" for r in report.get("vllm", [])))
    return report


def _simulate(serving: DraftServing, prompts: EvalPrompts, tokenizer, eval_config: EvalConfig,
              stops: tuple[int, ...]) -> tuple[dict[str, Any], GreedyAnswers]:
    """The HF target's greedy answers to every turn, and the simulated acceptance of the trained
    and an untrained draft at every k and temperature."""
    from eagle_ray.draft.export import exported_target

    aux_layer_ids = list(exported_target(serving.draft_dir).aux_layer_ids)
    target = HFEagle3TargetModel.from_pretrained(
        serving.model_path, aux_layer_ids=aux_layer_ids, dtype=serving.dtype,
        device="cuda" if torch.cuda.is_available() else None)
    embedding = target.get_input_embeddings().weight.detach()
    # The drafts in fp32 (as trained), on the target's device.
    trained, vocab = load_exported_draft(serving.draft_dir, embedding.float())
    torch.manual_seed(1234)
    untrained = trained.untrained(embedding.float())
    trained, untrained = (d.to(embedding.device).eval() for d in (trained, untrained))
    n = eval_config.max_new_tokens
    greedy = GreedyAnswers(target, n, stops)
    turns, failed = answer_turn_by_turn(
        prompts.prompts, tokenizer, greedy,
        None if target.max_length is None else target.max_length - n)
    turn_prompts = [ids for prompt_turns in turns for ids in prompt_turns]
    report: dict[str, Any] = {
        "prompts": len(prompts.prompts), "turns": len(turn_prompts),
        "skipped_lines": prompts.skipped, "failed_prompts": len(failed),
        "num_speculative_tokens": list(eval_config.num_speculative_tokens),
        "temperatures": list(eval_config.temperatures), "simulated": [],
        # What parallel drafting is for: vLLM runs one draft forward per verify step for a
        # P-EAGLE or DFlash draft, k (one per drafted token) for an EAGLE-3 chain.
        "draft": {"kind": trained.kind, "forwards_per_verify_step": {
            str(k): 1 if trained.drafts_in_parallel else k
            for k in eval_config.num_speculative_tokens}},
        "served_with": dataclasses.asdict(serving)}
    report["draft"]["seconds_per_verify_step"] = {
        str(k): seconds for k, seconds in draft_seconds_per_verify_step(
            target, trained, vocab, turn_prompts[:4], eval_config.num_speculative_tokens).items()}
    continuations = greedy([], turn_prompts)
    report["target_top_probability"] = target_top_probability(target, turn_prompts,
                                                               continuations)
    for k, temperature in itertools.product(eval_config.num_speculative_tokens,
                                            eval_config.temperatures):
        row: dict[str, Any] = {"num_speculative_tokens": k, "temperature": temperature}
        for name, draft in (("trained", trained), ("untrained", untrained)):
            if temperature == 0:
                row[name], row[f"acceptance_per_position_{name}"] = simulate_acceptance(
                    target, draft, vocab, turn_prompts, continuations, k)
                continue
            run = simulate_sampled(target, draft, vocab, turn_prompts, k, temperature, n, stops,
                                   eval_config.seed)
            row[name], row[f"acceptance_per_position_{name}"] = (run.length(),
                                                                 run.tally.per_position())
            # Exact E[accepted | context] over the same verify steps (evaluation.simulate).
            row[f"{name}_expected"] = run.expected_length()
            row[f"{name}_expected_interval_95"] = list(run.expected_interval())
        if temperature > 0:
            logger.info("simulated k=%d t=%g: trained %.2f (exact %.2f), untrained %.2f (exact "
                        "%.2f)", k, temperature, row["trained"], row["trained_expected"],
                        row["untrained"], row["untrained_expected"])
        report["simulated"].append(row)
    return report, greedy


def evaluate_on_cluster(target: PoolConfig, serving: DraftServing, prompts: EvalPrompts,
                        eval_config: EvalConfig) -> dict[str, Any]:
    """`evaluate_draft` as a Ray task that asks for what a replica of `target` asks for (its
    GPUs, CPUs and custom resources): the driver, on a head without GPUs or memory for the
    target, loads no model; the task runs where the target's GPUs are."""
    import ray

    from eagle_ray.pool.placement import replica_bundle

    bundle = replica_bundle(target)
    options = {"num_cpus": bundle.pop("CPU"), "num_gpus": bundle.pop("GPU", 0),
               "resources": bundle, "max_retries": 0}
    logger.info("evaluating the draft in a Ray task with %s", options)
    task = ray.remote(evaluate_draft).options(**options)
    return ray.get(task.remote(serving, prompts, eval_config))
