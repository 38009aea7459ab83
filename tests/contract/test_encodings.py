"""The three target encodings must give the trainer the same targets and the same loss."""

import pytest
import torch

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.contract.supervision import DraftVocab, draft_target, soft_cross_entropy
from eagle_ray.testing import random_micro_batch


@pytest.fixture(scope="module")
def draft_vocab(hf_llama):
    # Half the vocabulary, so some argmaxes fall outside it and the position mask matters.
    counts = torch.arange(hf_llama.vocab_size) % 7
    return DraftVocab.from_token_counts(counts, hf_llama.vocab_size // 2)


def test_three_encodings_give_the_same_draft_targets_and_loss(hf_llama, draft_vocab):
    input_ids, attention_mask, loss_mask = random_micro_batch(hf_llama.vocab_size)
    target = HFEagle3TargetModel(hf_llama.model, draft_vocab=draft_vocab)
    head = target.get_target_head()
    targets = {}
    for encoding in ("logits", "last_hidden", "target_probs"):
        batch = target.generate_batch(input_ids, attention_mask, loss_mask, encoding=encoding)
        assert batch.encoding == encoding
        targets[encoding] = (batch, *draft_target(batch, draft_vocab, head))
    draft_logits = torch.randn(*input_ids.shape, draft_vocab.size,
                               generator=torch.Generator().manual_seed(0))
    reference_batch, reference_probs, reference_mask = targets["logits"]
    has_next = reference_batch.attention_mask.bool().roll(-1, 1)
    has_next[:, -1] = False
    # The mask is informative: some real positions are in, some are out of the draft vocab.
    assert 0 < int((reference_mask & has_next).sum()) < int(has_next.sum())
    reference_loss = soft_cross_entropy(draft_logits, reference_probs, reference_mask,
                                        reference_batch.loss_mask)
    for encoding, (batch, probs, mask) in targets.items():
        assert torch.equal(mask & has_next, reference_mask & has_next), encoding
        torch.testing.assert_close(probs[has_next], reference_probs[has_next],
                                   rtol=0, atol=1e-6)
        loss = soft_cross_entropy(draft_logits, probs, mask, batch.loss_mask)
        torch.testing.assert_close(loss, reference_loss, rtol=0, atol=1e-6)


def test_draft_vocab_offsets_follow_vllm_convention():
    vocab = DraftVocab.from_target_ids([3, 7, 8, 20], target_vocab_size=32)
    assert (torch.arange(4) + vocab.d2t).tolist() == [3, 7, 8, 20]
    assert vocab.t2d.nonzero().flatten().tolist() == [3, 7, 8, 20]


def test_draft_vocab_round_trips_through_a_file(tmp_path):
    vocab = DraftVocab.from_token_counts(torch.tensor([4, 0, 9, 9, 1]), 3)
    assert vocab.draft_to_target.tolist() == [0, 2, 3]
    vocab.save(tmp_path / "vocab.json")
    loaded = DraftVocab.load(tmp_path / "vocab.json")
    assert torch.equal(loaded.draft_to_target, vocab.draft_to_target)
    assert loaded.target_vocab_size == 5


def test_target_probs_without_a_draft_vocab_is_a_clear_error(hf_llama):
    input_ids, attention_mask, loss_mask = random_micro_batch(hf_llama.vocab_size, (5,))
    assert hf_llama.draft_vocab is None
    with pytest.raises(ValueError, match="needs a draft_vocab"):
        hf_llama.generate_batch(input_ids, attention_mask, loss_mask, encoding="target_probs")
