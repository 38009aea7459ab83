"""The pre-trained tiny target with tokenised kit chats and a draft vocabulary, for tests that
train a draft on it."""

import torch
from transformers import AutoTokenizer

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.data import answer_token_counts, tokenize_chats
from eagle_ray.supervision import DraftVocab
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
