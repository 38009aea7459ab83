"""Acceptance length of a draft against its target, measured two independent ways.

1. vLLM itself serving the exported draft as the target's `eagle3` speculative model, at each
   `eval.num_speculative_tokens` k and `eval.temperatures` temperature, with intervals
   (`eagle_ray.acceptance`); at temperature 0 its output must equal the target's greedy output
   without speculation.
2. The project's own chain-drafting simulation with the HF target (`eagle_ray.simulate`) on
   the same turns, at the same k and temperatures, for the trained draft and an untrained one
   (the baseline): independent of vLLM's speculative decoding, so each checks the other (at
   temperature 0 they agree exactly).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle_ray.acceptance import answer_turn_by_turn, vllm_acceptance_table
from eagle_ray.backends.base import Sampling
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.chat import stop_token_ids
from eagle_ray.config import ConfigError, EvalConfig
from eagle_ray.draft.export import load_exported_draft
from eagle_ray.draft.model import Eagle3Draft
from eagle_ray.eval_prompts import EvalPrompt, EvalPrompts, read_eval_prompts
from eagle_ray.simulate import simulate_acceptance, simulate_sampled_acceptance

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
    simulation's continuation and the reference vLLM's greedy output must equal."""

    def __init__(self, target: HFEagle3TargetModel, max_new_tokens: int,
                 stop_token_ids: tuple[int, ...]) -> None:
        self.target, self.max_new_tokens, self.stops = target, max_new_tokens, stop_token_ids
        self._answers: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, owners: list[int], batch: list[list[int]]) -> list[list[int]]:
        for ids in batch:
            if tuple(ids) not in self._answers:
                self._answers[tuple(ids)] = greedy_generate(self.target, ids,
                                                            self.max_new_tokens, self.stops)
        return [self._answers[tuple(ids)] for ids in batch]


def evaluate_draft(model_path: str, draft_dir: str | Path, prompts: EvalPrompts, tokenizer,
                   eval_config: EvalConfig, engine_kwargs: dict[str, Any] | None = None,
                   ) -> dict[str, Any]:
    """Acceptance of the exported draft: vLLM serving it at every k and temperature of
    `eval_config` (`eagle_ray.acceptance`), and, side by side at the same settings, the
    project's own simulation of the trained and of an untrained draft on the same turns; on the
    target the draft was exported for (its aux layer ids), loaded from `model_path`."""
    from eagle_ray.draft.export import exported_target, exported_ttt_steps

    check_eval_settings(eval_config, exported_ttt_steps(draft_dir),
                        f"the draft's {Path(draft_dir) / 'config.json'} eagle_ray_ttt_steps")
    served = exported_target(draft_dir)
    target = HFEagle3TargetModel.from_pretrained(model_path, list(served.aux_layer_ids),
                                                 dtype=torch.float32)
    embedding = target.get_input_embeddings().weight.detach()
    trained, vocab = load_exported_draft(draft_dir, embedding)
    torch.manual_seed(1234)
    untrained = Eagle3Draft(trained.config, embedding)
    n = eval_config.max_new_tokens
    stops = stop_token_ids(tokenizer)  # answers end at the chat's end-of-turn token
    greedy = GreedyAnswers(target, n, stops)
    turns, failed = answer_turn_by_turn(
        prompts.prompts, tokenizer, greedy,
        None if target.max_length is None else target.max_length - n)
    turn_prompts = [ids for prompt_turns in turns for ids in prompt_turns]
    report: dict[str, Any] = {
        "prompts": len(prompts.prompts), "turns": len(turn_prompts),
        "skipped_lines": prompts.skipped, "failed_prompts": len(failed),
        "num_speculative_tokens": list(eval_config.num_speculative_tokens),
        "temperatures": list(eval_config.temperatures), "simulated": []}
    continuations = greedy([], turn_prompts)
    for k, temperature in itertools.product(eval_config.num_speculative_tokens,
                                            eval_config.temperatures):
        row: dict[str, Any] = {"num_speculative_tokens": k, "temperature": temperature}
        for name, draft in (("trained", trained.eval()), ("untrained", untrained.eval())):
            row[name], row[f"acceptance_per_position_{name}"] = simulate_acceptance(
                target, draft, vocab, turn_prompts, continuations, k) if temperature == 0 \
                else simulate_sampled_acceptance(target, draft, vocab, turn_prompts, k,
                                                 temperature, n, stops, eval_config.seed)
        report["simulated"].append(row)
    if eval_config.vllm:
        report["vllm"] = vllm_acceptance_table(
            model_path, draft_dir, prompts.prompts, tokenizer,
            eval_config.num_speculative_tokens, eval_config.temperatures, n, stops,
            reference=greedy, bootstrap_samples=eval_config.bootstrap_samples,
            seed=eval_config.seed, engine_kwargs=engine_kwargs)
    logger.info("evaluation on %d prompts (%d turns): %s", len(prompts.prompts),
                len(turn_prompts), "; ".join(
                    f"k={r['num_speculative_tokens']} t={r['temperature']:g} "
                    f"{r['mean_acceptance_length']:.2f}" for r in report.get("vllm", [])))
    return report
