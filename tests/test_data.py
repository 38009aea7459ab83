"""The data pipeline: truncation and what it counts, vocabulary sizes, the draft vocabulary."""

import pytest
import torch

from eagle_ray.chat import tokenize_conversation
from eagle_ray.config import ConfigError
from eagle_ray.data import load_or_build_draft_vocab, tokenize_chats

LONG = [{"role": "user", "content": "Describe a red apple in one sentence."},
        {"role": "assistant", "content": " ".join(["The red apple stands out."] * 20)}]
SHORT = [{"role": "user", "content": "What is one plus two?"},
         {"role": "assistant", "content": "One plus two is three."}]
NO_ANSWER = [{"role": "user", "content": "Hello?"}]
NOT_ALTERNATING = [{"role": "assistant", "content": "I start."},
                   {"role": "assistant", "content": "And go on."}]


def conversations(*samples):
    return [(f"test:{i}", messages) for i, messages in enumerate(samples)]


@pytest.fixture
def qwen3(family_tokenizers):
    return family_tokenizers["qwen3"]


def test_overlong_rows_are_truncated_with_their_masks_and_counted(qwen3):
    full_ids, full_mask = tokenize_conversation(qwen3, LONG)
    limit = len(full_ids) // 2
    assert sum(full_mask[:limit]) > 0, "the cut keeps part of the answer"
    chats = tokenize_chats(conversations(LONG, SHORT, NO_ANSWER), qwen3, limit, vocab_size=2048)
    assert chats.counts() == {"kept": 2, "truncated": 1, "dropped_too_long": 0,
                              "dropped_no_answer": 1, "dropped_unrenderable": 0}
    ids, mask = chats.rows[0]
    assert ids == full_ids[:limit] and mask == full_mask[:limit]
    assert chats.rows[1] == tokenize_conversation(qwen3, SHORT)


def test_drop_mode_keeps_the_old_behaviour(qwen3):
    limit = len(tokenize_conversation(qwen3, LONG)[0]) - 1
    chats = tokenize_chats(conversations(LONG, SHORT), qwen3, limit, vocab_size=2048,
                           overlong="drop")
    assert chats.counts()["kept"] == 1 and chats.dropped_too_long == 1 and chats.truncated == 0


def test_a_cut_that_leaves_no_answer_drops_the_row(qwen3):
    ids, mask = tokenize_conversation(qwen3, SHORT)
    first_answer_token = mask.index(1)
    chats = tokenize_chats(conversations(SHORT), qwen3, first_answer_token, vocab_size=2048)
    assert chats.rows == [] and chats.dropped_no_answer == 1


def test_conversations_the_template_refuses_are_counted(family_tokenizers):
    chats = tokenize_chats(conversations(NOT_ALTERNATING, SHORT), family_tokenizers["mistral"],
                           4096, vocab_size=2048)
    assert chats.dropped_unrenderable == 1 and len(chats.rows) == 1


def test_token_ids_outside_the_target_vocabulary_are_an_error(qwen3):
    ids, _ = tokenize_conversation(qwen3, SHORT)
    with pytest.raises(ValueError, match=rf"test:0: token id {max(ids)} is outside"):
        tokenize_chats(conversations(SHORT), qwen3, 4096, vocab_size=max(ids))


def test_the_draft_vocabulary_indexes_the_padded_target_vocabulary(qwen3, tmp_path):
    chats = tokenize_chats(conversations(SHORT, LONG), qwen3, 4096, vocab_size=1088)
    vocab = load_or_build_draft_vocab(tmp_path / "vocab.json", chats.rows, 1088, 64)
    assert vocab.target_vocab_size == 1088 and vocab.t2d.numel() == 1088
    answer_tokens = {t for ids, mask in chats.rows for t, m in zip(ids, mask, strict=True) if m}
    assert answer_tokens <= set(vocab.draft_to_target.tolist())
    full = load_or_build_draft_vocab(tmp_path / "full.json", chats.rows, 1088, 1088)
    assert torch.equal(full.draft_to_target, torch.arange(1088))


def test_a_draft_vocabulary_larger_than_the_target_is_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match="draft_vocab_size 2000 exceeds the target's vocabulary "
                                          r"\(1088\); set it to at most 1088"):
        load_or_build_draft_vocab(tmp_path / "vocab.json", [], 1088, 2000)
