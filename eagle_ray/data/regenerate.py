"""Replace the assistant turns of a chat dataset with the target's own answers, through the pool.

A draft is trained to predict its target; answers written by someone else (another model, a
human) teach it what the target would *not* say. Real EAGLE-3 recipes therefore regenerate the
answers with the target first. Here the pool's replicas do it -- the same vLLM engines that
produce supervision, through the router, re-run on another replica when one dies -- turn by turn:
each answer is generated for the conversation so far, whose earlier answers are already the
regenerated ones.

The output keeps each line's shape (`messages` or ShareGPT `conversations`) and adds
`eagle_ray_regenerated`: the source line, the sampling settings, the target's fingerprint and
whether any answer changed. Lines are appended and flushed as conversations finish, so an
interrupted run resumes where it stopped (finished source lines are skipped).

Example, on a running pool:
    >>> client = PoolClient.connect("eagle_ray_pool", "eagle_ray")            # doctest: +SKIP
    >>> report = regenerate_file(client, tokenizer, "chats.jsonl", "regen.jsonl",
    ...                          Sampling(max_new_tokens=256))               # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle_ray.backends.base import Sampling
from eagle_ray.data.chat import (
    SHAREGPT_ROLES,
    conversation_key,
    conversation_messages,
    prompt_for_turn,
    stop_token_ids,
)
from eagle_ray.pool.client import MicroBatchFailed, PoolClient

logger = logging.getLogger(__name__)

META_KEY = "eagle_ray_regenerated"


@dataclasses.dataclass
class RegenerationReport:
    """What a run did (`resumed`: conversations a previous run had finished)."""

    conversations: int = 0
    changed: int = 0  # output conversations (resumed ones too) with an answer that differs
    answers: int = 0
    generated_tokens: int = 0
    resumed: int = 0
    failed: int = 0  # a prompt too long for the target, or no replica could serve it
    seconds: float = 0.0

    @property
    def changed_share(self) -> float:
        """Share of the output's conversations (this run's and resumed ones) whose answers
        differ from the source's."""
        return self.changed / max(self.conversations + self.resumed, 1)


def regenerate_file(client: PoolClient, tokenizer, input_path: str | Path,
                    output_path: str | Path, sampling: Sampling, *, fingerprint: str = "",
                    skip_keys: frozenset[str] | set[str] = frozenset(),
                    conversations_per_wave: int = 256, prompts_per_request: int = 16,
                    progress: bool = True) -> RegenerationReport:
    """Regenerate every assistant turn of `input_path` into `output_path` (see module doc),
    leaving out conversations whose `chat.conversation_key` is in `skip_keys` (held out)."""
    started = time.monotonic()
    sampling = dataclasses.replace(sampling, stop_token_ids=stop_token_ids(tokenizer))
    finished = _finished_lines(Path(output_path))
    pending = [(line_no, sample) for line_no, sample in _read_samples(input_path)
               if line_no not in finished and conversation_key(
                   conversation_messages(sample, f"{input_path}:{line_no}")) not in skip_keys]
    report = RegenerationReport(resumed=len(finished), changed=sum(finished.values()))
    meta = {"sampling": {k: v for k, v in dataclasses.asdict(sampling).items()
                         if k != "stop_token_ids"}, "target": fingerprint}
    bar = tqdm(total=len(pending), unit="conv", desc="regenerating", disable=not progress)
    with open(output_path, "a") as out:
        for start in range(0, len(pending), conversations_per_wave):
            wave = pending[start:start + conversations_per_wave]
            for line_no, sample, answers in _answer_wave(client, tokenizer, wave, sampling,
                                                         prompts_per_request, report):
                if answers is None:
                    report.failed += 1
                    continue
                changed = _write(out, sample, answers, {**meta, "source_line": line_no})
                report.conversations += 1
                report.changed += changed
            bar.update(len(wave))
            elapsed = time.monotonic() - started
            bar.set_postfix(tokens_per_s=f"{report.generated_tokens / max(elapsed, 1e-9):.0f}")
    bar.close()
    report.seconds = time.monotonic() - started
    logger.info("regenerated %d conversations (%d changed, %d resumed, %d failed) -> %s",
                report.conversations, report.changed, report.resumed, report.failed,
                output_path)
    return report


def _answer_wave(client: PoolClient, tokenizer, wave: list[tuple[int, dict]],
                 sampling: Sampling, prompts_per_request: int, report: RegenerationReport):
    """Yield `(line_no, sample, new answers or None)`: the wave's conversations answered turn
    by turn, each turn's prompts for all conversations sent together."""
    conversations = [conversation_messages(sample, f"line {line_no}")
                     for line_no, sample in wave]
    turns = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in conversations]
    failed: set[int] = set()
    for k in range(max(map(len, turns), default=0)):
        asking = [c for c in range(len(wave)) if k < len(turns[c]) and c not in failed]
        prompts = {c: prompt_for_turn(tokenizer, conversations[c], turns[c][k]) for c in asking}
        for c, generated in _generate(client, prompts, sampling, prompts_per_request).items():
            if generated is None:
                failed.add(c)
                continue
            tokens = generated[:-1] if generated and generated[-1] in sampling.stop_token_ids \
                else generated
            # Special tokens inside an answer (a weak target's) would be re-read as markup.
            conversations[c][turns[c][k]]["content"] = tokenizer.decode(
                tokens, skip_special_tokens=True)
            report.answers += 1
            report.generated_tokens += len(generated)
    for c, (line_no, sample) in enumerate(wave):
        yield line_no, sample, (None if c in failed else
                                [conversations[c][i]["content"] for i in turns[c]])


def _generate(client: PoolClient, prompts: dict[int, list[int]], sampling: Sampling,
              prompts_per_request: int) -> dict[int, list[int] | None]:
    """Generated tokens per key; None where the prompt is longer than the target holds or no
    replica could serve it."""
    room = (client.max_length if client.max_length is not None else 10**9) + 1
    results: dict[int, list[int] | None] = {
        k: None for k, prompt in prompts.items() if len(prompt) + sampling.max_new_tokens > room}
    if results:
        logger.warning("%d conversations have prompts too long for the target (%d tokens with "
                       "max_new_tokens=%d); they are skipped", len(results), room,
                       sampling.max_new_tokens)
    servable = [k for k in prompts if k not in results]
    requests = {}  # request id -> its keys
    for start in range(0, len(servable), prompts_per_request):
        chunk = servable[start:start + prompts_per_request]
        requests[client.submit_completion([prompts[k] for k in chunk], sampling)] = chunk
    for request_id, chunk in requests.items():
        try:
            results.update(zip(chunk, client.result(request_id), strict=True))
        except MicroBatchFailed as e:
            logger.warning("regeneration request failed: %s", e)
            results.update(dict.fromkeys(chunk))
    return results


def _write(out, sample: dict, answers: list[str], meta: dict[str, Any]) -> bool:
    """Append `sample` with its assistant turns replaced by `answers`, in its own shape."""
    sample = copy.deepcopy(sample)
    if "messages" in sample:
        turns, text_key = [t for t in sample["messages"] if t["role"] == "assistant"], "content"
    else:
        turns = [t for t in sample["conversations"]
                 if SHAREGPT_ROLES.get(t["from"]) == "assistant"]
        text_key = "value"
    changed = any(t[text_key] != a for t, a in zip(turns, answers, strict=True))
    for turn, answer in zip(turns, answers, strict=True):
        turn[text_key] = answer
    sample[META_KEY] = {**meta, "changed": changed}
    out.write(json.dumps(sample) + "\n")
    out.flush()
    return changed


def _read_samples(path: str | Path):
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                yield line_no, json.loads(line)


def _finished_lines(path: Path) -> dict[int, bool]:
    """Source lines an earlier run finished (-> whether an answer changed); a torn last line
    (killed mid-write) is removed."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    finished, kept = {}, []
    for line in lines:
        try:
            meta = json.loads(line)[META_KEY]
            finished[meta["source_line"]] = bool(meta["changed"])
            kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning("dropping a torn line from %s (an interrupted run)", path)
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))
    return finished
