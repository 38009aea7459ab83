"""Chat data -> right-padded micro-batches with an assistant-token loss mask."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


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
