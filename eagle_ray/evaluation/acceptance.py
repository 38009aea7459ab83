"""Acceptance length the way published drafts are compared: vLLM serving the draft as the
target's `eagle3` speculative model, chain drafting `k` tokens, at a sampling temperature, over a
set of prompts answered turn by turn; per prompt from vLLM's per-request counters, then pooled
(1 + accepted / verify steps, vLLM's own definition) with a 95 % bootstrap interval over prompts.
The greedy reference is the same engine without the draft (`reference_engine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from eagle_ray.backends.base import Sampling
from eagle_ray.backends.vllm import draft_forwards
from eagle_ray.console import native_output_to_log
from eagle_ray.data.chat import prompt_for_turn
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.prompts import EvalPrompt

logger = logging.getLogger(__name__)

TEMPLATE_TOKENS_PER_TURN = 16  # what a chat template writes around an answer, at most

# `(which prompts, their token ids)` -> the answers' token ids, for one turn of a batch.
Answerer = Callable[[list[int], list[list[int]]], list[list[int]]]
# `(which prompt, its messages for the turn)` -> the turn's token ids, as the target sees them.
Renderer = Callable[[int, list[dict[str, Any]]], list[int]]


@dataclasses.dataclass(frozen=True)
class PromptForm:
    """How a measurement's prompts reach vLLM where a turn is not its chat-template token ids
    sent as they are: `render` gives a turn's token ids as the target sees them (the engine's
    room is checked against them, answers are keyed by them), `request(prompt, ids)` the vLLM
    prompt sent for them; `engine_kwargs` join every engine's arguments and `max_model_len`
    replaces `eval_max_model_len`'s. A vision-language target's image prompts (their
    placeholders collapsed, their images beside them: `eagle_ray.evaluation.images`)."""

    render: Renderer
    request: Callable[[int, list[int]], Any]
    max_model_len: int
    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ServedAnswer:
    """One answer vLLM sampled: the turn's prompt as sent, the tokens it emitted (its stop token
    included), and its per-request counters (verify steps by draft tokens accepted; None when
    none was verified). `eagle_ray.evaluation.paired` replays it."""

    prompt: list[int]
    answer: list[int]
    histogram: list[int] | None


@dataclasses.dataclass
class AcceptanceTally:
    """Verify steps by how many draft tokens each accepted (`histogram[j]`, j = 0..k): one
    prompt's (vLLM's per-request counters), or a whole measurement's (the simulation)."""

    histogram: list[int]

    @classmethod
    def empty(cls, k: int) -> AcceptanceTally:
        return cls([0] * (k + 1))

    @property
    def steps(self) -> int:
        return sum(self.histogram)

    @property
    def accepted(self) -> int:
        return sum(j * count for j, count in enumerate(self.histogram))

    def add(self, histogram: Sequence[int]) -> None:
        for j, count in enumerate(histogram):
            self.histogram[j] += count

    def record(self, accepted: int) -> None:
        """One verify step that accepted `accepted` draft tokens."""
        self.histogram[accepted] += 1

    def length(self) -> float:
        """1 + accepted / verify steps (vLLM's definition); NaN before any step."""
        return 1 + self.accepted / self.steps if self.steps else float("nan")

    def per_position(self) -> list[float]:
        """Per draft position, the share of verify steps that accepted it."""
        steps = self.steps
        return [sum(self.histogram[j + 1:]) / steps if steps else float("nan")
                for j in range(len(self.histogram) - 1)]


def summarise(tallies: Sequence[AcceptanceTally], k: int, bootstrap_samples: int = 1000,
              seed: int = 0) -> dict[str, Any]:
    """Pooled acceptance length over prompts, its 95 % bootstrap interval (prompts resampled
    with replacement), and per draft position the share of verify steps that accepted it."""
    pooled = AcceptanceTally.empty(k)
    for tally in tallies:
        pooled.add(tally.histogram)
    steps = np.array([t.steps for t in tallies], dtype=np.float64)
    accepted = np.array([t.accepted for t in tallies], dtype=np.float64)
    result: dict[str, Any] = {
        "prompts": len(tallies), "verify_steps": pooled.steps,
        "accepted_tokens": pooled.accepted, "mean_acceptance_length": pooled.length(),
        "interval_95": [float("nan"), float("nan")],
        "acceptance_per_position": pooled.per_position(),
    }
    if pooled.steps and len(tallies) > 1:
        picks = np.random.default_rng(seed).integers(0, len(tallies),
                                                      (bootstrap_samples, len(tallies)))
        resampled_steps = steps[picks].sum(1)
        lengths = 1 + accepted[picks].sum(1) / np.maximum(resampled_steps, 1)
        lengths = lengths[resampled_steps > 0]
        result["interval_95"] = [float(np.percentile(lengths, 2.5)),
                                 float(np.percentile(lengths, 97.5))]
    return result


def answer_turn_by_turn(prompts: Sequence[EvalPrompt], tokenizer, answer: Answerer,
                        max_prompt_tokens: int | None = None, render: Renderer | None = None
                        ) -> tuple[list[list[list[int]]], dict[int, str]]:
    """Every prompt's turns answered in order (all prompts' turn t in one batch), each answer
    joining the conversation before the next turn. Returns per prompt the token ids of each
    turn's prompt as sent, and the prompts that failed (index -> why): one whose next turn is
    longer than `max_prompt_tokens` stops there and is counted, not sent. `render` (prompt's
    index, messages) -> token ids replaces the tokenizer's chat template."""
    sent: list[list[list[int]]] = [[] for _ in prompts]
    answers: list[list[str]] = [[] for _ in prompts]
    failed: dict[int, str] = {}
    for turn in range(max(len(p.turns) for p in prompts)):
        batch = []
        for i, prompt in enumerate(prompts):
            if turn >= len(prompt.turns) or i in failed:
                continue
            messages = prompt.messages_for_turn(turn, answers[i])
            ids = (prompt_for_turn(tokenizer, messages, len(messages)) if render is None
                   else render(i, messages))
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                failed[i] = (f"turn {turn + 1} is {len(ids)} tokens, more than the "
                             f"{max_prompt_tokens} the engine leaves before an answer of "
                             f"eval.max_new_tokens (lower it, or shorten the prompt)")
                continue
            batch.append((i, ids))
        if not batch:
            break
        owners, batch_ids = [i for i, _ in batch], [ids for _, ids in batch]
        for (i, ids), answer_ids in zip(batch, answer(owners, batch_ids), strict=True):
            sent[i].append(ids)
            answers[i].append(tokenizer.decode(answer_ids, skip_special_tokens=True))
    return sent, failed


def vllm_acceptance_table(
    serving: DraftServing, prompts: Sequence[EvalPrompt], tokenizer,
    ks: Sequence[int], temperatures: Sequence[float], max_new_tokens: int,
    stop_token_ids: Sequence[int] = (), reference: Answerer | None = None,
    bootstrap_samples: int = 1000, seed: int = 0, samples_per_prompt: int = 1,
    served: dict[tuple[int, float], list[ServedAnswer]] | None = None,
    form: PromptForm | None = None,
) -> list[dict[str, Any]]:
    """One row per (k, temperature): `summarise`'s figures, the prompts that failed (counted,
    with why), the draft forwards vLLM ran (`draft_forwards.since`), and at temperature 0 the
    share of answers equal to `reference`'s (the target's greedy answers without speculation;
    speculation must not change them; `reference` answers None for a prompt it does not know,
    which counts as changed). At a temperature above 0 each prompt is answered
    `samples_per_prompt` times (its answers pooled, the bootstrap resampling prompts), and
    every answer goes into `served[k, temperature]` (for `eagle_ray.evaluation.paired`).
    `form`: how the prompts reach vLLM, where not as chat-template token ids (`PromptForm`)."""
    rows = []
    max_model_len = form.max_model_len if form is not None else eval_max_model_len(
        serving.model_path, prompts, tokenizer, max_new_tokens)
    for k in ks:
        with evaluation_engine(serving, k, max_model_len, seed,
                               form.engine_kwargs if form is not None else None) as llm:
            for temperature in temperatures:
                before = draft_forwards.read(llm)
                answers = None if served is None or temperature == 0 else served.setdefault(
                    (k, temperature), [])
                rows.append(_measure(llm, prompts, tokenizer, k, temperature, max_new_tokens,
                                     stop_token_ids, reference, bootstrap_samples, seed,
                                     samples_per_prompt, answers, form))
                rows[-1]["draft_forwards"] = draft_forwards.since(llm, before)
                logger.info("acceptance k=%d temperature %.1f: %.2f (95%% %.2f-%.2f) over %d "
                            "prompts", k, temperature, rows[-1]["mean_acceptance_length"],
                            *rows[-1]["interval_95"], rows[-1]["prompts"])
    return rows


def _measure(llm, prompts: Sequence[EvalPrompt], tokenizer, k: int, temperature: float,
             max_new_tokens: int, stop_token_ids: Sequence[int], reference: Answerer | None,
             bootstrap_samples: int, seed: int, samples_per_prompt: int = 1,
             served: list[ServedAnswer] | None = None, form: PromptForm | None = None
             ) -> dict[str, Any]:
    sampling = Sampling(max_new_tokens, temperature, stop_token_ids=tuple(stop_token_ids))
    copies = samples_per_prompt if temperature > 0 else 1  # greedy answers would repeat
    asked = [prompt for prompt in prompts for _ in range(copies)]
    tallies = [AcceptanceTally.empty(k) for _ in asked]
    greedy_equal: list[bool] = []

    def answer(owners: list[int], batch: list[list[int]]) -> list[list[int]]:
        outputs = _generate(llm, batch if form is None else [
            form.request(i // copies, ids) for i, ids in zip(owners, batch, strict=True)], sampling)
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        for i, ids, output in zip(owners, batch, outputs, strict=True):
            metrics = output.outputs[0].spec_decode_metrics
            histogram = None if metrics is None else list(metrics.histogram)
            if histogram is not None:  # None: the answer ended before a draft was verified
                tallies[i].add(histogram)
            if served is not None:
                served.append(ServedAnswer(list(ids), list(output.outputs[0].token_ids),
                                           histogram))
        if temperature == 0 and reference is not None:
            greedy_equal.extend(r is not None and a == r for a, r in zip(
                answers, reference(owners, batch), strict=True))
        return answers

    room = llm.llm_engine.model_config.max_model_len - max_new_tokens
    _, failed = answer_turn_by_turn(asked, tokenizer, answer, room, None if form is None else (
        lambda i, messages: form.render(i // copies, messages)))
    per_prompt: dict[int, AcceptanceTally] = {}  # a prompt's answers pooled, failed ones left out
    for i, tally in enumerate(tallies):
        if i not in failed:
            per_prompt.setdefault(i // copies, AcceptanceTally.empty(k)).add(tally.histogram)
    row = {"num_speculative_tokens": k, "temperature": temperature,
           **summarise(list(per_prompt.values()), k, bootstrap_samples, seed),
           "answers_per_prompt": copies, "failed": len({i // copies for i in failed}),
           "failures": sorted(set(failed.values()))[:3]}
    if greedy_equal:
        row["greedy_equal_fraction"] = sum(greedy_equal) / len(greedy_equal)
    return row


def _generate(llm, prompts: Sequence[list[int] | Mapping[str, Any]], sampling: Sampling
              ) -> list[Any]:
    """vLLM's outputs for token-id prompts (or vLLM prompts as they are, e.g. with images).
    No per-request seed: on vLLM 0.32's CPU build a seeded request's sampled verify steps draw
    skewed uniforms and leave the target's distribution (docs/training.md, "vLLM at
    temperature 1"); the engine's own seed (`evaluation_engine`) keeps a run reproducible."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                            top_p=sampling.top_p, stop_token_ids=list(sampling.stop_token_ids),
                            detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p
                         for p in prompts], params,
                        use_tqdm=False)


def eval_max_model_len(model_path: str, prompts: Sequence[EvalPrompt], tokenizer,
                       max_new_tokens: int, extra_tokens: int = 0) -> int:
    """Room for the longest prompt with every turn answered in full (and a few tokens of the
    template's around each answer), and `extra_tokens` more, within the target's positions:
    sized for these prompts, not the checkpoint's 131,072 positions a Llama-3.1 would claim
    (`eagle_ray.backends.sizing`)."""
    from transformers import AutoConfig

    def rendered(prompt: EvalPrompt) -> int:  # every turn, each answer empty
        messages = prompt.messages_for_turn(len(prompt.turns) - 1, [""] * len(prompt.turns))
        return len(prompt_for_turn(tokenizer, messages, len(messages)))

    longest = max(rendered(p) + len(p.turns) * (max_new_tokens + TEMPLATE_TOKENS_PER_TURN)
                  for p in prompts)
    positions = AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings
    return min(longest + 1 + extra_tokens, positions)


@contextlib.contextmanager
def evaluation_engine(serving: DraftServing, k: int | None, max_model_len: int, seed: int,
                      engine_kwargs: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """vLLM serving the draft as the target's speculative model with `k` tokens per step (as
    `serving.command(k)` does), keeping per-request acceptance counters; with `k` None the same
    engine without the draft (the reference). Its sampling seeded with `seed`; its draft
    forwards counted (`draft_forwards`); shut down on exit, so the next engine gets the device.
    `engine_kwargs` join the engine's arguments (a vision-language target's)."""
    from eagle_ray.backends.vllm.runner import serving_engine

    kwargs = serving.target_engine_kwargs() if k is None else {
        **serving.engine_kwargs(k), "per_request_spec_decode_metrics": "summary",
        "worker_extension_cls": draft_forwards.EXTENSION}
    with contextlib.ExitStack() as stack:
        with native_output_to_log():
            llm = stack.enter_context(serving_engine({
                **kwargs, **(engine_kwargs or {}), "max_model_len": max_model_len,
                "seed": seed}))
        if k is not None:
            draft_forwards.start_counting(llm)
        yield llm


class ServedTarget:
    """The target alone on a plain vLLM engine (`evaluation_engine` without a draft), generating
    as a backend's `complete` does; its requests are sent as the measured ones are."""

    def __init__(self, llm) -> None:
        self.llm = llm

    @property
    def max_model_len(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    def complete(self, prompts: Sequence[list[int] | Mapping[str, Any]], sampling: Sampling
                 ) -> list[list[int]]:
        """The generated tokens (stop token included) for each prompt, in one batch."""
        return [list(o.outputs[0].token_ids) for o in _generate(self.llm, prompts, sampling)]


@contextlib.contextmanager
def reference_engine(serving: DraftServing, max_model_len: int, seed: int,
                     engine_kwargs: Mapping[str, Any] | None = None) -> Iterator[ServedTarget]:
    """The target as `serving` serves it (checkpoint, dtype, tensor-parallel size, tokenizer,
    `max_model_len`, seed) without its draft: the standard reference for "speculative decoding
    changed nothing"."""
    with evaluation_engine(serving, None, max_model_len, seed, engine_kwargs) as llm:
        yield ServedTarget(llm)
