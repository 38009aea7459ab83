"""Training precision (`train.precision`): bf16 autocast learns what fp32 learns, and the device
rules for choosing it."""

import pytest
import torch
from transformers import AutoTokenizer

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.chat import prompt_for_turn, stop_token_ids
from eagle_ray.data import make_micro_batches, tokenize_chats
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, ttt_loss
from eagle_ray.evaluate import greedy_generate
from eagle_ray.simulate import simulate_acceptance
from eagle_ray.supervision import DraftVocab, draft_target
from eagle_ray.tiny import generate_chat_samples, tiny_target
from eagle_ray.train_device import DevicePrefetcher, autocast_dtype


def test_precision_rules_on_the_cpu():
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None  # fp32: the CPU's bf16 is slower
    assert autocast_dtype("fp32", cpu) is None
    assert autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(ValueError, match=r"train.precision must be one of .*'fp16'"):
        autocast_dtype("fp16", cpu)


def test_the_cpu_prefetcher_hands_over_host_and_device_batches(hf_llama):
    from eagle_ray.testing import random_micro_batch

    batches = [hf_llama.generate_batch(*random_micro_batch(hf_llama.vocab_size, seed=i))
               for i in range(3)]
    pairs = list(DevicePrefetcher(iter(batches), torch.device("cpu")))
    assert [host for host, _ in pairs] == batches
    for host, device in pairs:
        assert torch.equal(host.aux_hidden_states, device.aux_hidden_states)


def _train_and_measure(target, vocab, micro_batches, prompts, continuations, precision):
    config = DraftConfig.from_target(target.model.config, vocab.size)
    torch.manual_seed(0)
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach())
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    head = target.get_target_head()
    for batch in micro_batches:
        probs, mask = draft_target(batch, vocab, head)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _, _ = ttt_loss(draft, batch.aux_hidden_states, batch.input_ids,
                                  batch.loss_mask, probs, mask, ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    acceptance, _ = simulate_acceptance(target, draft.eval(), vocab, prompts, continuations, k=3)
    return acceptance


def test_bf16_training_reaches_the_acceptance_of_fp32_on_the_tiny_kit():
    path = tiny_target("llama", pretrained=True)
    target = HFEagle3TargetModel.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    samples = [(f"sample {i}", s["messages"]) for i, s in
               enumerate(generate_chat_samples(96, seed=3))]
    rows = tokenize_chats(samples[8:], tokenizer, 256, target.vocab_size).rows
    counts = torch.zeros(target.vocab_size)
    for ids, mask in rows:
        counts.index_add_(0, torch.tensor(ids), torch.tensor(mask, dtype=torch.float))
    vocab = DraftVocab.from_token_counts(counts, 256)
    supervision = [target.generate_batch(*mb) for mb in
                   make_micro_batches(rows, 8) * 5]  # 5 epochs of 11 micro-batches
    prompts = [prompt_for_turn(tokenizer, messages, len(messages) - 1)  # up to the answer
               for _, messages in samples[:8]]
    stops = tuple(stop_token_ids(tokenizer))
    continuations = [greedy_generate(target, p, 24, stops) for p in prompts]
    untrained = _train_and_measure(target, vocab, [], prompts, continuations, "fp32")
    fp32 = _train_and_measure(target, vocab, supervision, prompts, continuations, "fp32")
    bf16 = _train_and_measure(target, vocab, supervision, prompts, continuations, "bf16")
    assert fp32 > untrained + 0.3, (untrained, fp32)  # training matters at this size
    assert abs(bf16 - fp32) <= 0.1, (fp32, bf16)
