"""The data pipeline: truncation and what it counts, vocabulary sizes, the draft vocabulary,
token-budget micro-batches."""

import json
import random

import pytest
import torch

from eagle_ray.config import ConfigError
from eagle_ray.data.chat import tokenize_conversation
from eagle_ray.data.draft_vocab import answer_token_counts, load_or_build_draft_vocab
from eagle_ray.data.micro_batches import make_micro_batches, token_budget_micro_batches
from eagle_ray.data.tokenize import tokenize_chats

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
    assert chats.counts() == {"kept": 1, "truncated": 1, "dropped_too_long": 0,
                              "dropped_no_answer": 1, "dropped_unrenderable": 0}
    ids, mask = chats.rows[0]
    assert ids == full_ids[:limit] and mask == full_mask[:limit]
    assert chats.rows[1] == tokenize_conversation(qwen3, SHORT)


def test_drop_mode_keeps_the_old_behaviour(qwen3):
    limit = len(tokenize_conversation(qwen3, LONG)[0]) - 1
    chats = tokenize_chats(conversations(LONG, SHORT), qwen3, limit, vocab_size=2048,
                           overlong="drop")
    assert chats.counts() == {"kept": 1, "truncated": 0, "dropped_too_long": 1,
                              "dropped_no_answer": 0, "dropped_unrenderable": 0}


def test_a_cut_that_leaves_no_answer_drops_the_row(qwen3):
    ids, mask = tokenize_conversation(qwen3, SHORT)
    first_answer_token = mask.index(1)
    chats = tokenize_chats(conversations(SHORT), qwen3, first_answer_token, vocab_size=2048)
    assert chats.rows == [] and chats.counts()["dropped_no_answer"] == 1


def test_conversations_the_template_refuses_are_counted(family_tokenizers):
    chats = tokenize_chats(conversations(NOT_ALTERNATING, SHORT), family_tokenizers["mistral"],
                           4096, vocab_size=2048)
    assert chats.counts()["dropped_unrenderable"] == 1 and len(chats.rows) == 1


def test_token_ids_outside_the_target_vocabulary_are_an_error(qwen3):
    ids, _ = tokenize_conversation(qwen3, SHORT)
    with pytest.raises(ValueError, match=rf"test:0: token id {max(ids)} is outside"):
        tokenize_chats(conversations(SHORT), qwen3, 4096, vocab_size=max(ids))


def test_the_draft_vocabulary_indexes_the_padded_target_vocabulary(qwen3, tmp_path):
    chats = tokenize_chats(conversations(SHORT, LONG), qwen3, 4096, vocab_size=1088)

    def count():
        return answer_token_counts(chats.rows, 1088), chats.counts()

    vocab, statuses = load_or_build_draft_vocab(tmp_path / "vocab.json", {"data": 1}, count,
                                                1088, 64)
    assert vocab.target_vocab_size == 1088 and vocab.t2d.numel() == 1088
    assert statuses == chats.counts()
    answer_tokens = {t for ids, mask in chats.rows for t, m in zip(ids, mask, strict=True) if m}
    assert answer_tokens <= set(vocab.draft_to_target.tolist())
    full, _ = load_or_build_draft_vocab(tmp_path / "full.json", {"data": 1}, count, 1088, 1088)
    assert torch.equal(full.draft_to_target, torch.arange(1088))


def test_the_draft_vocabulary_cache_is_reused_only_for_the_same_source(qwen3, tmp_path):
    chats = tokenize_chats(conversations(SHORT), qwen3, 4096, vocab_size=1088)
    calls = []

    def count():
        calls.append(1)
        return answer_token_counts(chats.rows, 1088), chats.counts()

    for source in ({"data": "a"}, {"data": "a"}, {"data": "b"}):
        load_or_build_draft_vocab(tmp_path / "vocab.json", source, count, 1088, 64)
    assert len(calls) == 2, "counted for 'a', reused for 'a', counted again for 'b'"


def test_a_draft_vocabulary_larger_than_the_target_is_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match="draft_vocab_size 2000 exceeds the target's vocabulary "
                                          r"\(1088\); set it to at most 1088"):
        load_or_build_draft_vocab(tmp_path / "vocab.json", {}, lambda: None, 1088, 2000)


def test_token_budget_micro_batches_respect_the_budget_and_keep_every_row_once():
    rng = random.Random(0)
    rows = [([k] * n, [1] * n) for k, n in enumerate(rng.randint(5, 120) for _ in range(300))]
    batches = list(token_budget_micro_batches(rows, max_tokens=512, max_rows=16, window=64))
    seen = []
    for ids, attention, loss in batches:
        rows_in, width = ids.shape
        assert rows_in <= 16 and (rows_in * width <= 512 or rows_in == 1)
        seen += [int(row[0]) for row in ids]
        assert torch.equal(attention, loss)
    assert sorted(seen) == list(range(300)), "every row exactly once"


def test_a_row_longer_than_the_budget_travels_alone():
    batches = list(token_budget_micro_batches([([1] * 900, [1] * 900), ([2] * 10, [1] * 10)],
                                              max_tokens=512, max_rows=8))
    assert sorted(b[0].shape[0] for b in batches) == [1, 1]


def test_length_bucketing_pads_less_than_fixed_rows():
    rng = random.Random(1)
    rows = [([1] * n, [1] * n) for n in (rng.randint(5, 200) for _ in range(512))]
    bucketed = list(token_budget_micro_batches(rows, max_tokens=8 * 200, max_rows=8, window=256))
    fixed = make_micro_batches(rows, micro_batch_size=8)

    def padding(batches):
        return 1 - sum(float(b[1].sum()) for b in batches) / sum(b[1].numel() for b in batches)

    assert padding(bucketed) < 0.25 * padding(fixed), (padding(bucketed), padding(fixed))


def test_a_sharegpt_json_array_reads_as_its_jsonl_lines(tmp_path):
    from eagle_ray.data.chat import read_conversations

    samples = [{"conversations": [{"from": "human", "value": f"q{i}"},
                                  {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    (tmp_path / "dump.json").write_text("\n  " + json.dumps(samples))
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    array = list(read_conversations(tmp_path / "dump.json"))
    assert [m for _, m in array] == [m for _, m in read_conversations(tmp_path / "lines.jsonl")]
    assert array[2][0] == f"{tmp_path / 'dump.json'}[2]"
    assert array[0][1][1] == {"role": "assistant", "content": "a0"}


def test_epochs_become_the_micro_batches_a_worker_packs_per_pass():
    """`train.epochs` -> steps: the rows' lengths packed as `token_budget_micro_batches` packs
    them, per worker; checked against packing the rows themselves."""
    from eagle_ray.data.micro_batches import micro_batches_per_epoch

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 200, (301,), generator=generator).tolist()
    rows = [(list(range(n)), [1] * n) for n in lengths]
    packed = [len(list(token_budget_micro_batches(rows[w::2], 1024, 8, window=64)))
              for w in range(2)]
    assert micro_batches_per_epoch(lengths, 1024, 8, window=64, workers=2) == sum(packed) / 2
