"""Acceptance of a draft on image prompts (a vision-language target), measured on the pool's own
backend: the target's greedy answer to each held-out image prompt, then the project's chain
drafting simulation (`eagle_ray.evaluation.simulate`) of the trained and of an untrained draft
along it, at each `eval.num_speculative_tokens`, greedy (temperature 0: the simulation's
acceptance is then exact). The draft sits at the target's temporal M-RoPE positions and reads the
placeholder token's embedding at image positions, as vLLM's proposer feeds it (docs/contract.md,
"Images"), meant to be the figures vLLM serving it gives (vLLM 0.32 on CPU measures more:
tests/train/test_train_vision.py's xfail says why). With `eval.vllm`, vLLM serves
the draft beside the target at each k and measures it (`vllm_image_rows`: `report["vllm"]`, the
text evaluation's rows, through `eagle_ray.evaluation.acceptance`), against the target served
alone: its greedy answers must come out unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from eagle_ray.backends.base import RunnerEagle3TargetModel, Sampling
from eagle_ray.config import EvalConfig, PoolConfig
from eagle_ray.contract.images import ImageInputs, ImageTokens
from eagle_ray.data.chat import stop_token_ids
from eagle_ray.data.images import VisionProcessor, image_prompt, load_vision_processor
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.acceptance import PromptForm, reference_engine, vllm_acceptance_table
from eagle_ray.evaluation.prompts import EvalPrompt, EvalPrompts
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


def vllm_image_rows(serving: DraftServing, prompts: list[EvalPrompt], vision: VisionProcessor,
                    rendered: list[tuple[list[int], ImageInputs | None]],
                    eval_config: EvalConfig, stops: tuple[int, ...]
                    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """vLLM serving the draft beside the target at each k, greedy (`vllm_acceptance_table`'s
    rows), each prompt's first turn sent with its placeholder runs collapsed and its images
    beside it (`eagle_ray.backends.vllm.vision.image_prompts`); the reference is the target
    served alone, whose greedy answers are returned too."""
    from eagle_ray.backends.vllm import torchvision_shim
    from eagle_ray.backends.vllm.vision import image_prompts, vision_engine_kwargs

    torchvision_shim.install()  # vLLM's processor runs in this process too
    tokens = ImageTokens(vision.image_token_id, vision.patch_size, vision.merge_size)
    requests = [image_prompts(torch.tensor([ids]), [len(ids)], image, tokens)[0]
                for ids, image in rendered]
    n, ks = eval_config.max_new_tokens, eval_config.num_speculative_tokens
    form = PromptForm(render=lambda i, _: rendered[i][0], request=lambda i, _: requests[i],
                      max_model_len=max(len(ids) for ids, _ in rendered) + n + max(ks) + 1,
                      engine_kwargs=vision_engine_kwargs({}))
    with reference_engine(serving, form.max_model_len, eval_config.seed,
                          form.engine_kwargs) as served:
        greedy = served.complete(requests, Sampling(n, 0.0, stop_token_ids=stops))
    first_turns = [dataclasses.replace(p, turns=p.turns[:1]) for p in prompts]
    rows = vllm_acceptance_table(
        serving, first_turns, vision.tokenizer, ks, [0.0], n, stops,
        reference=lambda owners, _: [greedy[i] for i in owners],
        bootstrap_samples=eval_config.bootstrap_samples, seed=eval_config.seed, form=form)
    return rows, greedy


def evaluate_on_images(pool: PoolConfig, serving: DraftServing, prompts: EvalPrompts,
                       eval_config: EvalConfig) -> dict[str, Any]:
    """The evaluation report of a draft for a vision-language target (the shape
    `evaluate_draft`'s has): each prompt's first user turn, its images resized and its
    placeholders expanded by the target's processor; vLLM's rows first where `eval.vllm`."""
    vision = load_vision_processor(serving.tokenizer or serving.model_path,
                                   pool.vllm_kwargs.get("mm_processor_kwargs"))
    stops = stop_token_ids(vision.tokenizer)
    n, ks = eval_config.max_new_tokens, eval_config.num_speculative_tokens
    rendered = [image_prompt(vision, p.messages_for_turn(0, [])) for p in prompts.prompts]
    prompt_ids = [ids for ids, _ in rendered]
    images = [image for _, image in rendered]
    longest = max(map(len, prompt_ids)) + n + max(ks)
    report: dict[str, Any] = {}
    if eval_config.vllm:  # before the pool's backend loads the target
        report["vllm"], served_answers = vllm_image_rows(serving, prompts.prompts, vision,
                                                         rendered, eval_config, stops)
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
    if eval_config.vllm:  # vLLM's target alone against the pool backend's: same greedy answers?
        report["vllm_target_equals_pool_fraction"] = sum(
            a == b for a, b in zip(served_answers, answers, strict=True)) / len(answers)
    return {**report, "prompts": len(rendered), "turns": len(rendered),
            "images": sum(0 if i is None else int(i.images_per_row.sum()) for i in images),
            "skipped_lines": prompts.skipped, "failed_prompts": 0,
            "num_speculative_tokens": list(ks), "temperatures": [0.0],
            "served_with": dataclasses.asdict(serving), "simulated": rows}
