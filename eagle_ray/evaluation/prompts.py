"""Evaluation prompts as the published draft comparisons use them.

A prompt is a conversation so far (`context`: system and earlier turns) and the user turns the
target answers one after another (`turns`), each answer joining the context before the next
turn, as MT-Bench is run. Read from JSONL in any of these shapes:

- MT-Bench: `{"turns": ["first question", "follow-up", ...], ...}`
- GSM8K: `{"question": "...", "answer": "..."}` (the reference answer is not used)
- the trainer's formats (`messages`, ShareGPT `conversations`): the conversation up to its last
  user turn is the context, and that turn is answered.

A line that is none of these, or has no user turn, is counted by reason, never skipped silently.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from eagle_ray.config.loader import ConfigError
from eagle_ray.data.chat import ChatFormatError, conversation_messages

Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    """A conversation so far and the user turns the target answers, in order."""

    context: tuple[dict[str, str], ...]
    turns: tuple[str, ...]
    where: str = ""  # file:line, for messages

    @classmethod
    def from_conversation(cls, messages: Messages, where: str = "") -> EvalPrompt:
        """The conversation up to its last user turn, and that turn."""
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ChatFormatError(f"{where}: no user turn to answer")
        return cls(tuple(messages[:last_user]), (messages[last_user]["content"],), where)

    def messages_for_turn(self, turn: int, answers: Sequence[str]) -> Messages:
        """The messages the target answers at `turn`, given its answers to the earlier ones."""
        messages = list(self.context)
        for k in range(turn):
            messages += [{"role": "user", "content": self.turns[k]},
                         {"role": "assistant", "content": answers[k]}]
        return messages + [{"role": "user", "content": self.turns[turn]}]


@dataclasses.dataclass
class EvalPrompts:
    """The prompts read from a file, and the lines that gave none (`skipped`: reason -> count)."""

    prompts: list[EvalPrompt]
    skipped: dict[str, int]


def read_eval_prompts(path: str | Path, limit: int | None = None) -> EvalPrompts:
    """The first `limit` prompts of a JSONL file (see the module doc for the shapes)."""
    prompts: list[EvalPrompt] = []
    skipped: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                prompts.append(parse_eval_prompt(json.loads(line), where))
            except json.JSONDecodeError:
                skipped["not JSON"] += 1
            except (ChatFormatError, TypeError) as e:
                skipped[_reason(e)] += 1
    if not prompts:
        raise ConfigError(f"{path} has no usable evaluation prompt ({dict(skipped) or 'empty'});"
                          f" give JSONL lines with `turns` (MT-Bench), `question` (GSM8K), "
                          f"`messages` or `conversations`")
    return EvalPrompts(prompts, dict(skipped))


def parse_eval_prompt(sample: object, where: str) -> EvalPrompt:
    """One JSONL line's prompt, whichever of the shapes it has."""
    if not isinstance(sample, dict):
        raise TypeError(f"{where}: a line is a JSON object, got {type(sample).__name__}")
    if "turns" in sample:
        turns = sample["turns"]
        if not isinstance(turns, list) or not turns or \
                not all(isinstance(t, str) and t.strip() for t in turns):
            raise ChatFormatError(f"{where}: `turns` must be a list of non-empty strings")
        return EvalPrompt((), tuple(turns), where)
    if "question" in sample:
        question = sample["question"]
        if not isinstance(question, str) or not question.strip():
            raise ChatFormatError(f"{where}: `question` must be a non-empty string")
        return EvalPrompt((), (question,), where)
    return EvalPrompt.from_conversation(conversation_messages(sample, where), where)


def _reason(error: Exception) -> str:
    """A skip reason without the line's location (so reasons count across lines)."""
    return str(error).split(": ", 1)[-1]
