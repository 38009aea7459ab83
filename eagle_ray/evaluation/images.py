"""Acceptance of a draft on image prompts (a vision-language target), measured on the pool's own
backend: the target's greedy answer to each held-out image prompt, then the project's chain
drafting simulation (`eagle_ray.evaluation.simulate`) of the trained and of an untrained draft
along it, at each `eval.num_speculative_tokens`, greedy (temperature 0: the simulation's
acceptance is then exact). The draft sits at the target's temporal M-RoPE positions and reads the
placeholder token's embedding at image positions, as vLLM's proposer feeds it (docs/contract.md,
"Images"), so these are the figures vLLM serving it would give.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from eagle_ray.backends.base import RunnerEagle3TargetModel
from eagle_ray.config import EvalConfig, PoolConfig
from eagle_ray.contract.images import ImageInputs
from eagle_ray.data.chat import stop_token_ids
from eagle_ray.data.images import image_prompt, load_vision_processor
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.prompts import EvalPrompts
from eagle_ray.evaluation.simulate import (
    load_drafts,
    row_states,
    simulate_acceptance,
    simulation_target,
)

logger = logging.getLogger(__name__)


@torch.inference_mode()
def greedy_answer(target: RunnerEagle3TargetModel, prompt: list[int],
                  images: ImageInputs | None, max_new_tokens: int,
                  stops: tuple[int, ...]) -> list[int]:
    """The target's greedy continuation of `prompt` (its `images` in view), up to and including
    a stop token: the whole sequence re-run per token, so no cached M-RoPE state carries over
    (these prompts are short)."""
    head = target.get_target_head()
    seq, answer = list(prompt), []
    while len(answer) < max_new_tokens:
        _, last_hidden, _ = row_states(target, seq, images)
        token = int(head(last_hidden[0, -1]).argmax())
        answer.append(token)
        seq.append(token)
        if token in stops:
            break
    return answer


def evaluate_on_images(pool: PoolConfig, serving: DraftServing, prompts: EvalPrompts,
                       eval_config: EvalConfig) -> dict[str, Any]:
    """The evaluation report of a draft for a vision-language target (the shape
    `evaluate_draft`'s has, without vLLM's rows): each prompt's first user turn, its images
    resized and its placeholders expanded by the target's processor."""
    vision = load_vision_processor(serving.tokenizer or serving.model_path,
                                   pool.vllm_kwargs.get("mm_processor_kwargs"))
    stops = stop_token_ids(vision.tokenizer)
    n, ks = eval_config.max_new_tokens, eval_config.num_speculative_tokens
    rendered = [image_prompt(vision, p.messages_for_turn(0, [])) for p in prompts.prompts]
    prompt_ids = [ids for ids, _ in rendered]
    images = [image for _, image in rendered]
    longest = max(map(len, prompt_ids)) + n + max(ks)
    with simulation_target(pool, serving, longest) as target:
        answers = [greedy_answer(target, ids, image, n, stops) for ids, image in rendered]
        trained, untrained, vocab = load_drafts(target, serving.draft_dir)
        rows = []
        for k in ks:
            row: dict[str, Any] = {"num_speculative_tokens": k, "temperature": 0.0}
            for name, draft in (("trained", trained), ("untrained", untrained)):
                length, per_position = simulate_acceptance(target, draft, vocab, prompt_ids,
                                                           answers, k, images)
                row.update({name: length, f"acceptance_per_position_{name}": per_position})
            logger.info("image prompts, k=%d: trained %.2f, untrained %.2f", k, row["trained"],
                        row["untrained"])
            rows.append(row)
    return {"prompts": len(rendered), "turns": len(rendered),
            "images": sum(0 if i is None else int(i.images_per_row.sum()) for i in images),
            "skipped_lines": prompts.skipped, "failed_prompts": 0,
            "num_speculative_tokens": list(ks), "temperatures": [0.0],
            "served_with": dataclasses.asdict(serving), "simulated": rows}
