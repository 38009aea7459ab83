"""Chat data -> right-padded micro-batches with an assistant-token loss mask; the draft vocab."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from eagle_ray.supervision import DraftVocab

logger = logging.getLogger(__name__)


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from e


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a mask that is 1 on assistant tokens.

    Needs a chat template that marks assistant turns with `{% generation %}`.
    """
    enc = tokenizer.apply_chat_template(messages, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    if not any(mask):
        raise ValueError("the chat template marked no assistant tokens; it needs "
                         "{% generation %} ... {% endgeneration %} around assistant turns")
    return ids, mask


def collate(rows: Iterable[tuple[list[int], list[int]]],
            pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad `(ids, loss_mask)` rows into `input_ids, attention_mask, loss_mask [B, S]`."""
    rows = list(rows)
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    seq = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask)
    return input_ids, attention_mask, loss_mask


@dataclasses.dataclass
class TokenizedChats:
    """Tokenised conversations and what was dropped on the way (reported, never silent)."""

    rows: list[tuple[list[int], list[int]]]  # (token ids, assistant-token loss mask)
    dropped_too_long: int = 0
    dropped_no_answer: int = 0


def tokenize_chats(samples: Iterable[dict], tokenizer, max_length: int) -> TokenizedChats:
    """Tokenise `{"messages": [...]}` samples with the chat template; drop rows over
    `max_length` tokens and rows without assistant tokens, counting both."""
    out = TokenizedChats(rows=[])
    for i, sample in enumerate(samples):
        if "messages" not in sample:
            raise ValueError(f"sample {i} has no 'messages' key (chat JSONL expected), "
                             f"got keys {sorted(sample)}")
        try:
            ids, mask = tokenize_chat(tokenizer, sample["messages"])
        except ValueError:
            out.dropped_no_answer += 1
            continue
        if len(ids) > max_length:
            out.dropped_too_long += 1
            continue
        out.rows.append((ids, mask))
    logger.info("tokenised %d conversations; dropped %d longer than %d tokens and %d without "
                "assistant tokens", len(out.rows), out.dropped_too_long, max_length,
                out.dropped_no_answer)
    return out


def answer_token_counts(rows: Iterable[tuple[list[int], list[int]]],
                        vocab_size: int) -> torch.Tensor:
    """How often each target token occurs as an answer (loss-masked) token."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in rows:
        answer = torch.tensor([t for t, m in zip(ids, mask, strict=True) if m], dtype=torch.long)
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def load_or_build_draft_vocab(path: str | Path, rows, vocab_size: int,
                              draft_vocab_size: int) -> DraftVocab:
    """The draft vocabulary cached at `path`; built from answer-token counts when absent or
    when it was built for other sizes."""
    path = Path(path)
    if path.exists():
        vocab = DraftVocab.load(path)
        if vocab.size == draft_vocab_size and vocab.target_vocab_size == vocab_size:
            logger.info("reusing draft vocabulary %s (%d tokens)", path, vocab.size)
            return vocab
    vocab = DraftVocab.from_token_counts(answer_token_counts(rows, vocab_size),
                                         min(draft_vocab_size, vocab_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab.save(path)
    logger.info("built draft vocabulary of %d tokens -> %s", vocab.size, path)
    return vocab


def make_micro_batches(rows: list[tuple[list[int], list[int]]], micro_batch_size: int,
                       pad_id: int = 0, seed: int = 0
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Shuffle (seeded) and group rows into right-padded micro-batches."""
    if not rows:
        raise ValueError("no rows to batch (all filtered out?)")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [collate([rows[i] for i in order[start:start + micro_batch_size]], pad_id)
            for start in range(0, len(order), micro_batch_size)]
