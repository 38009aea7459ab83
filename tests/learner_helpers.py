"""A small draft under the training loop's own learner (`DraftLearner`, CPU, fp32) and random
supervision for it: for tests of the learner's bookkeeping (resume, skipped steps), not of what
it learns."""

import torch

from eagle_ray.config import TrainConfig
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.train.loop import DraftLearner

HIDDEN, VOCAB, ROWS, SEQ = 32, 64, 2, 8


def tiny_learner(seed: int = 0, prepare=None, **train) -> DraftLearner:
    """An EAGLE-3 draft of width `HIDDEN` over a full `VOCAB` draft vocabulary, seeded;
    `train`: `TrainConfig` keys over the test's defaults."""
    torch.manual_seed(seed)
    config = DraftConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=HIDDEN // 2, intermediate_size=64,
                         vocab_size=VOCAB, draft_vocab_size=VOCAB)
    head = TargetHead(torch.nn.RMSNorm(HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    settings = {"precision": "fp32", "steps": 10, "warmup_steps": 2, "ttt_steps": 2, **train}
    return DraftLearner(Eagle3Draft(config), head.requires_grad_(False),
                        DraftVocab(torch.arange(VOCAB), VOCAB), TrainConfig(**settings),
                        torch.device("cpu"), prepare)


def tiny_batch(seed: int = 0, poison: str | None = None) -> Eagle3TargetBatch:
    """Random `last_hidden` supervision for `tiny_learner`; `poison`: the field given one NaN."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    fields = {"aux_hidden_states": torch.randn(ROWS, SEQ, 3 * HIDDEN, generator=generator),
              "last_hidden": torch.randn(ROWS, SEQ, HIDDEN, generator=generator)}
    if poison is not None:
        fields[poison][1, 3, 5] = float("nan")
    return Eagle3TargetBatch(**fields, input_ids=ids, attention_mask=torch.ones_like(ids),
                             loss_mask=torch.ones_like(ids))
