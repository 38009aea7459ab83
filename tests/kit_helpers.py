"""The pre-trained tiny target with tokenised kit chats and a draft vocabulary, for tests that
train a draft on it."""

import torch
from transformers import AutoTokenizer

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.draft_vocab import answer_token_counts
from eagle_ray.data.tokenize import tokenize_chats
from eagle_ray.tiny import generate_chat_samples, tiny_target


def kit_rows(num_samples: int, seed: int, draft_vocab_size: int = 256):
    """(the pre-trained tiny Llama in fp32, its tokenizer, the kit's `num_samples` chats as
    (ids, loss mask) rows, the draft vocabulary of their answer tokens)."""
    path = tiny_target("llama", pretrained=True)
    target = HFEagle3TargetModel.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    samples = [(f"sample {i}", s["messages"]) for i, s in
               enumerate(generate_chat_samples(num_samples, seed=seed))]
    rows = tokenize_chats(samples, tokenizer, 256, target.vocab_size).rows
    counts = answer_token_counts(rows, target.vocab_size)
    return target, tokenizer, rows, DraftVocab.from_token_counts(counts, draft_vocab_size)


def perturbed_kind_draft(target, kind: str, num_layers: int, mask_token_id: int = 0):
    """(a draft vocabulary, the draft config, a draft of `kind` on `target`'s embedding with its
    weights moved away from the initialisation's symmetric norms, in eval mode), seed 0."""
    from eagle_ray.draft.kinds import build_draft
    from eagle_ray.draft.model import DraftConfig

    vocab = DraftVocab.from_token_counts(torch.arange(target.vocab_size) % 5 + 1, 128)
    config = DraftConfig.from_target(target.model.config, vocab.size, num_layers=num_layers)
    torch.manual_seed(0)
    draft = build_draft(kind, config, target.get_input_embeddings().weight.detach(),
                        mask_token_id, anchors_per_row=10**4)
    for p in draft.parameters():
        if p.requires_grad:
            p.data.add_(0.05 * torch.randn_like(p))
    return vocab, config, draft.eval()


def train_draft_on_random_rows(target, draft, vocab, depth: int, steps: int = 30) -> list[float]:
    """`steps` AdamW steps of the draft's own objective over one random micro-batch of
    `target`'s supervision; the losses."""
    from eagle_ray.contract.supervision import draft_target
    from eagle_ray.testing import random_micro_batch

    batch = target.generate_batch(*random_micro_batch(target.vocab_size, (24, 17, 30)))
    probs, mask = draft_target(batch, vocab, target.get_target_head())
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _, _ = draft.objective(draft, batch.aux_hidden_states, batch.input_ids,
                                     batch.loss_mask, probs, mask, depth)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def counting_forwards(module, call):
    """(what `call()` returns, how many forwards of `module` it ran), without gradients."""
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            return call(), len(calls)
    finally:
        handle.remove()
