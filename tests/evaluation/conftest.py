"""Fixtures of the evaluation's tests: a tiny target and a draft trained on it."""

import pytest
import torch
from kit_helpers import kit_rows

from eagle_ray.data.chat import prompt_for_turn, stop_token_ids
from eagle_ray.data.micro_batches import make_micro_batches
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.tiny import generate_chat_samples


@pytest.fixture(scope="session")
def tiny_pair():
    """The pre-trained tiny Llama (fp32), a draft trained on it for 30 steps (the training
    loop's learner), its vocabulary, 48 held-out prompts and the stop tokens."""
    from eagle_ray.config import TrainConfig
    from eagle_ray.train.loop import DraftLearner

    target, tokenizer, rows, vocab = kit_rows(48, seed=5)
    supervision = [target.generate_batch(*mb) for mb in make_micro_batches(rows, 8)] * 5
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(target.model.config, vocab.size),
                        target.get_input_embeddings().weight.detach())
    learner = DraftLearner(draft, target.get_target_head(), vocab,
                           TrainConfig(steps=30, warmup_steps=2, lr=3e-3), torch.device("cpu"))
    for batch in supervision[:30]:
        learner.step(batch)
    prompts = [prompt_for_turn(tokenizer, s["messages"], 2)
               for s in generate_chat_samples(48, seed=321)]
    return target, learner.draft.eval(), vocab, prompts, tuple(stop_token_ids(tokenizer))
