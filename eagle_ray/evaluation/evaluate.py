"""Acceptance length of a draft against its target, measured two independent ways, where the
target's GPUs are (a Ray task: `evaluate_on_cluster`).

1. vLLM itself serving the exported draft as the target's `eagle3` speculative model, at each
   `eval.num_speculative_tokens` k and `eval.temperatures` temperature, with intervals
   (`eagle_ray.evaluation.acceptance`); at temperature 0 its output must equal the target's
   greedy output without speculation. Its engine counts the draft's forwards per verify step
   (`eagle_ray.backends.vllm.draft_forwards`): one for a parallel draft, k for a chain.
2. The project's own chain-drafting simulation (`eagle_ray.evaluation.simulate`) on the same
   turns, at the same k and temperatures, for the trained draft and an untrained one (the
   baseline), on the target's aux states and distributions from the pool's own backend (vLLM at
   the pool's tensor-parallel size by default): independent of vLLM's speculative decoding, so
   each checks the other (at temperature 0 they agree exactly). Above temperature 0 it also
   replays vLLM's own sampled answers (`eagle_ray.evaluation.paired`): the exact expectation
   of vLLM's figure on the same answers, which vLLM must match within its standard error.

The greedy reference both need (the turns' answers, and the output speculation must not change)
comes from vLLM serving the target as the draft is served, without the draft. One engine at a
time: the reference, then each k's serving engine, then the simulation's backend, each shut down
before the next starts.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle_ray.backends.base import RunnerEagle3TargetModel, Sampling
from eagle_ray.config import ConfigError, EvalConfig, PoolConfig
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.chat import stop_token_ids
from eagle_ray.draft.model import Eagle3Draft
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.acceptance import (
    ServedAnswer,
    answer_turn_by_turn,
    eval_max_model_len,
    reference_engine,
    vllm_acceptance_table,
)
from eagle_ray.evaluation.paired import replay_served
from eagle_ray.evaluation.prompts import EvalPrompt, EvalPrompts, read_eval_prompts
from eagle_ray.evaluation.simulate import (
    draft_seconds_per_verify_step,
    load_drafts,
    simulate_acceptance,
    simulate_sampled,
    simulation_target,
    target_top_probability,
)

logger = logging.getLogger(__name__)


class Completer(Protocol):
    """What generates the target's answers: a backend (`RunnerEagle3TargetModel`) or vLLM
    serving the target alone (`acceptance.ServedTarget`)."""

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]: ...


def greedy_generate(target: Completer, prompt: list[int], max_new_tokens: int,
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
    if eval_config.samples_per_prompt < 1:
        raise ConfigError(f"eval.samples_per_prompt={eval_config.samples_per_prompt}: sample "
                          f"at least one answer per prompt")


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
    """The target's greedy answer (no speculation) to each prompt, computed once, the prompts
    not answered yet in one `complete` call: what the simulation continues and what the vLLM
    serving the draft must output at temperature 0. Once `release`d (the engine or model freed
    for the next), an answer not computed before is None."""

    def __init__(self, target: Completer | None, max_new_tokens: int,
                 stop_token_ids: tuple[int, ...]) -> None:
        self.target = target
        self.sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
        self._answers: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, owners: list[int], batch: list[list[int]]) -> list[list[int] | None]:
        missing = list(dict.fromkeys(tuple(ids) for ids in batch
                                     if tuple(ids) not in self._answers))
        if missing and self.target is not None:
            answers = self.target.complete([list(ids) for ids in missing], self.sampling)
            self._answers.update(zip(missing, answers, strict=True))
        return [self._answers.get(tuple(ids)) for ids in batch]

    def release(self) -> None:
        """Drop the target (its memory goes back to the device)."""
        self.target = None
        _free_device_memory()


def greedy_reference(serving: DraftServing, prompts: Sequence[EvalPrompt], tokenizer,
                     max_new_tokens: int, stops: tuple[int, ...], seed: int
                     ) -> tuple[GreedyAnswers, list[list[list[int]]], dict[int, str]]:
    """Every turn answered greedily by vLLM serving the target with the served engine's
    settings (`DraftServing.target_engine_kwargs`, the `max_model_len` and seed of
    `vllm_acceptance_table`'s engines) but no draft: the answers, the turns' prompts as sent
    and the prompts that failed (`answer_turn_by_turn`). The engine is shut down before this
    returns."""
    max_model_len = eval_max_model_len(serving.model_path, prompts, tokenizer, max_new_tokens)
    with reference_engine(serving, max_model_len, seed) as engine:
        greedy = GreedyAnswers(engine, max_new_tokens, stops)
        turns, failed = answer_turn_by_turn(prompts, tokenizer, greedy,
                                            engine.max_model_len - max_new_tokens)
        greedy.release()
    return greedy, turns, failed


def evaluate_draft(target: PoolConfig, serving: DraftServing, prompts: EvalPrompts,
                   eval_config: EvalConfig) -> dict[str, Any]:
    """Acceptance of the exported draft: the target's greedy answers from vLLM without the draft
    (`greedy_reference`), vLLM serving the draft at every k and temperature of `eval_config` as
    `serving.command(k)` does (`eagle_ray.evaluation.acceptance`), then the project's own
    simulation of the trained and of an untrained draft on the pool's backend for `target`
    (`simulation_target`), with vLLM's sampled answers replayed, on the same turns; on the
    target the draft was exported for (its aux layer ids), in the target's dtype. Runs where it
    is called: a job runs it as a Ray task with the target's resources (`evaluate_on_cluster`).
    A vision-language target's draft is measured on image prompts instead
    (`eagle_ray.evaluation.images`)."""
    from eagle_ray.data.tokenizer_files import load_tokenizer
    from eagle_ray.draft.export import exported_ttt_steps

    if target.takes_images:
        from eagle_ray.evaluation.images import evaluate_on_images

        return evaluate_on_images(target, serving, prompts, eval_config)
    check_eval_settings(eval_config, exported_ttt_steps(serving.draft_dir),
                        f"the draft's {Path(serving.draft_dir) / 'config.json'} "
                        f"eagle_ray_ttt_steps")
    _, tokenizer = load_tokenizer(serving.model_path, {"tokenizer": serving.tokenizer}
                                  if serving.tokenizer else {}, "the evaluation")
    stops = stop_token_ids(tokenizer)  # answers end at the chat's end-of-turn token
    n, ks = eval_config.max_new_tokens, eval_config.num_speculative_tokens
    greedy, turns, failed = greedy_reference(serving, prompts.prompts, tokenizer, n, stops,
                                             eval_config.seed)
    turn_prompts = [ids for prompt_turns in turns for ids in prompt_turns]
    report: dict[str, Any] = {
        "prompts": len(prompts.prompts), "turns": len(turn_prompts),
        "skipped_lines": prompts.skipped, "failed_prompts": len(failed),
        "num_speculative_tokens": list(ks), "temperatures": list(eval_config.temperatures),
        "served_with": dataclasses.asdict(serving)}
    # A verify step sends up to k drafted tokens after a turn's prompt and its answer so far
    # (and the engine samples one token after them).
    longest = eval_max_model_len(serving.model_path, prompts.prompts, tokenizer, n, max(ks)) - 1
    served: dict[tuple[int, float], list[ServedAnswer]] = {}  # vLLM's sampled answers
    if eval_config.vllm:  # before the simulation, which replays vLLM's sampled answers
        report["vllm"] = vllm_acceptance_table(
            serving, prompts.prompts, tokenizer, ks, eval_config.temperatures, n, stops,
            reference=greedy, bootstrap_samples=eval_config.bootstrap_samples,
            seed=eval_config.seed, samples_per_prompt=eval_config.samples_per_prompt,
            served=served)
    report.update(_simulate(target, serving, longest, turn_prompts, greedy([], turn_prompts),
                            eval_config, stops, served))
    report["draft"].update(measured_draft_forwards(report.get("vllm", []), ks,
                                                   report["draft"]["kind"]))
    logger.info("evaluation on %d prompts (%d turns): %s", len(prompts.prompts),
                report["turns"], "; ".join(
                    f"k={r['num_speculative_tokens']} t={r['temperature']:g} "
                    f"{r['mean_acceptance_length']:.2f}" for r in report.get("vllm", [])))
    return report


def _simulate(pool: PoolConfig, serving: DraftServing, longest: int,
              turn_prompts: list[list[int]], continuations: list[list[int]],
              eval_config: EvalConfig, stops: tuple[int, ...],
              served: dict[tuple[int, float], list[ServedAnswer]]) -> dict[str, Any]:
    """On `simulation_target`: the simulated acceptance of the trained and an untrained draft at
    every k and temperature, the exact expectation on vLLM's own sampled answers (`served`,
    `eagle_ray.evaluation.paired`), the draft's time per verify step, and the target's top
    probability along its greedy answers (`continuations`)."""
    ks = eval_config.num_speculative_tokens
    with simulation_target(pool, serving, longest) as target:
        trained, untrained, vocab = load_drafts(target, serving.draft_dir)
        seconds = draft_seconds_per_verify_step(target, trained, vocab, turn_prompts[:4], ks)
        report: dict[str, Any] = {
            # Its forwards per verify step are counted where vLLM serves it (`draft_forwards`).
            "draft": {"kind": trained.kind,
                      "seconds_per_verify_step": {str(k): t for k, t in seconds.items()}},
            "target_top_probability": target_top_probability(target, turn_prompts,
                                                             continuations),
            "simulated": []}
        for k, temperature in itertools.product(ks, eval_config.temperatures):
            row: dict[str, Any] = {"num_speculative_tokens": k, "temperature": temperature}
            for name, draft in (("trained", trained), ("untrained", untrained)):
                row.update(_simulated(name, target, draft, vocab, turn_prompts, continuations,
                                      k, temperature, eval_config, stops))
            if temperature > 0:
                logger.info("simulated k=%d t=%g: trained %.2f (exact %.2f), untrained %.2f "
                            "(exact %.2f)", k, temperature, row["trained"],
                            row["trained_expected"], row["untrained"], row["untrained_expected"])
            if served.get((k, temperature)):
                row["trained_on_vllm_answers"] = _on_vllm_answers(
                    target, trained, vocab, served[k, temperature], k, temperature)
            report["simulated"].append(row)
    return report


def _on_vllm_answers(target: RunnerEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
                     answers: list[ServedAnswer], k: int, temperature: float) -> dict[str, Any]:
    """The exact expectation of vLLM's length on its own `answers` (`paired.replay_served`)."""
    paired = replay_served(target, draft, vocab, answers, k, temperature).summary()
    logger.info("k=%d t=%g: vLLM %.3f, exact on its %d answers %.3f (standard error %.3f, %d "
                "verify steps; %d of the answers replayed with vLLM's own step count)", k,
                temperature, paired["vllm_length"], paired["answers"], paired["expected"],
                paired["standard_error"], paired["verify_steps"],
                paired["answers_with_vllms_steps"])
    return paired


def measured_draft_forwards(rows: Sequence[dict[str, Any]], ks: Sequence[int], kind: str
                            ) -> dict[str, Any]:
    """The draft forwards per verify step vLLM ran at each k (its rows' counts pooled over
    temperatures; None where nothing was counted), and whether they are what a draft of `kind`
    runs -- one pass if it drafts in parallel, k chained ones if not (logged where not: a P-EAGLE
    draft served without `parallel_drafting` runs as a chain)."""
    from eagle_ray.backends.vllm.draft_forwards import DraftForwards
    from eagle_ray.draft.kinds import draft_class

    parallel = draft_class(kind).drafts_in_parallel
    measured: dict[str, float | None] = {}
    as_its_kind: list[bool] = []
    for k in ks:
        counts = [DraftForwards(**r["draft_forwards"]) for r in rows
                  if r["num_speculative_tokens"] == k and r.get("draft_forwards")]
        per_step = sum(counts, DraftForwards()).per_verify_step()
        measured[str(k)] = None if per_step is None else round(per_step, 3)
        if per_step is not None:
            as_its_kind.append(math.isclose(per_step, 1 if parallel else k))
            if not as_its_kind[-1]:
                logger.warning("vLLM ran %.3g draft forwards per verify step at k=%d, where a "
                               "%s draft runs %s", per_step, k, kind, "one" if parallel else k)
    return {"forwards_per_verify_step": measured,
            "drafts_as_its_kind": all(as_its_kind) if as_its_kind else None}


def _simulated(name: str, target: RunnerEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
               turn_prompts: list[list[int]], continuations: list[list[int]], k: int,
               temperature: float, eval_config: EvalConfig, stops: tuple[int, ...]
               ) -> dict[str, Any]:
    """One draft's cells of a simulated row: greedy against the target's answers, or sampled
    with the exact expectation over the same verify steps (`evaluation.simulate`)."""
    if temperature == 0:
        length, per_position = simulate_acceptance(target, draft, vocab, turn_prompts,
                                                   continuations, k)
        return {name: length, f"acceptance_per_position_{name}": per_position}
    run = simulate_sampled(target, draft, vocab, turn_prompts, k, temperature,
                           eval_config.max_new_tokens, stops, eval_config.seed)
    return {name: run.length(), f"acceptance_per_position_{name}": run.tally.per_position(),
            f"{name}_expected": run.expected_length(),
            f"{name}_expected_interval_95": list(run.expected_interval())}


def _free_device_memory() -> None:
    """Collect what a shut-down engine or a dropped model left and hand the device's cached
    memory back: the next engine sizes its KV cache from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    return ray.get(task.remote(target, serving, prompts, eval_config))
