"""The draft model, its TTT loss and its export, without Ray."""

import json

import pytest
import torch

from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.draft.attention import reference_ttt_attention, ttt_attention
from eagle_ray.draft.export import (
    export_draft,
    exported_target,
    load_exported_draft,
    validate_export,
)
from eagle_ray.draft.model import (
    DraftConfig,
    Eagle3Draft,
    shift_left,
    ttt_loss,
)
from eagle_ray.testing import random_micro_batch
from eagle_ray.train.memory import TensorMemoryProbe


@pytest.fixture(scope="module")
def setup(hf_llama):
    vocab = DraftVocab.from_token_counts(torch.arange(hf_llama.vocab_size) % 5 + 1, 128)
    config = DraftConfig.from_target(hf_llama.model.config, vocab.size)
    return hf_llama, vocab, config


@pytest.fixture(scope="module")
def served(hf_llama, llama_path):
    return TargetIdentity.of_backend(hf_llama, str(llama_path))


def test_ttt_training_on_the_tiny_target_lowers_the_loss(setup):
    target, vocab, config = setup
    torch.manual_seed(0)
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach())
    batch = target.generate_batch(*random_micro_batch(target.vocab_size, (24, 17, 30)))
    probs, mask = draft_target(batch, vocab, target.get_target_head())
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        loss, per_step, accuracy = ttt_loss(draft, batch.aux_hidden_states, batch.input_ids,
                                            batch.loss_mask, probs, mask,
                                            ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        assert len(per_step) == len(accuracy) == 3
    assert losses[-1] < 0.7 * losses[0], losses
    assert not draft.embed_tokens.weight.requires_grad


def test_later_ttt_steps_attend_to_their_own_diagonal_only(setup):
    target, vocab, config = setup
    torch.manual_seed(0)
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach()).eval()
    aux = torch.randn(1, 6, 3 * config.target_hidden_size)
    ids = torch.randint(0, config.vocab_size, (1, 6))
    changed = ids.clone()
    changed[0, 2] = (ids[0, 2] + 1) % config.vocab_size
    with torch.no_grad():
        base = draft(aux, [ids, ids])
        other = draft(aux, [ids, changed])  # step 1 reads a different token at slot 2
    assert torch.equal(base[0], other[0])  # step 0 does not see step 1's tokens
    assert torch.equal(base[1][0, :2], other[1][0, :2])  # earlier slots do not see slot 2
    assert not torch.equal(base[1][0, 2], other[1][0, 2])
    # ... and later slots do not see it either: a step-1 query attends to step 1's key at its
    # own slot only (a causal mask over step-1 keys would let slots 3.. see slot 2).
    assert torch.equal(base[1][0, 3:], other[1][0, 3:])


def test_export_round_trips_and_writes_vllm_layer_ids(setup, served, tmp_path):
    target, vocab, config = setup
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach())
    out = export_draft(draft, vocab, served, tmp_path)
    exported = json.loads((out / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.aux_layer_ids]
    assert exported_target(out) == served
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
    assert exported["vocab_size"] == target.vocab_size
    loaded, loaded_vocab = load_exported_draft(out, target.get_input_embeddings().weight)
    assert torch.equal(loaded_vocab.draft_to_target, vocab.draft_to_target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_export_validation_catches_what_vllm_would_not(setup, served, tmp_path):
    from safetensors.torch import load_file, save_file

    target, vocab, config = setup
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach())
    out = export_draft(draft, vocab, served, tmp_path)
    weights = load_file(str(out / "model.safetensors"))

    save_file({**weights, "d2t": vocab.draft_to_target.clone()}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t maps draft ids outside|ascending"):
        validate_export(out, served)  # absolute ids instead of offsets
    fc = weights["fc.weight"][:, : 2 * config.target_hidden_size].contiguous()
    save_file({**weights, "fc.weight": fc}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight has shape"):
        validate_export(out, served)
    save_file(weights, str(out / "model.safetensors"))
    exported = json.loads((out / "config.json").read_text())
    for wrong in ([5, 2, 4], [1, 3, 4]):  # unordered; ordered but not the captured layers
        (out / "config.json").write_text(json.dumps(
            {**exported, "eagle_aux_hidden_state_layer_ids": wrong}))
        with pytest.raises(ValueError, match="not the layers the target was captured at"):
            validate_export(out, served)


def test_a_full_vocabulary_draft_exports_without_d2t(setup, served, tmp_path):
    target, _, _ = setup
    full = DraftVocab(torch.arange(target.vocab_size), target.vocab_size)
    config = DraftConfig.from_target(target.model.config, full.size)
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach())
    out = export_draft(draft, full, served, tmp_path)
    from safetensors.torch import load_file

    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    loaded, loaded_vocab = load_exported_draft(out, target.get_input_embeddings().weight)
    assert torch.equal(loaded_vocab.draft_to_target, full.draft_to_target)


def _draft_pair(config):
    """The same draft weights with the efficient and the materialised attention."""
    torch.manual_seed(0)
    draft = Eagle3Draft(config)
    reference = Eagle3Draft(config, attention=reference_ttt_attention)
    reference.load_state_dict(draft.state_dict())
    return draft, reference


@pytest.mark.parametrize("kv_heads", [1, 2])  # grouped-query K/V, and one K/V head for two
def test_linear_memory_attention_equals_the_materialised_one(kv_heads):
    config = DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=2,
                         num_key_value_heads=kv_heads, head_dim=32, intermediate_size=96,
                         vocab_size=50, draft_vocab_size=50)
    draft, reference = _draft_pair(config)
    lengths = (13, 7, 2)
    ids, attention_mask, loss_mask = random_micro_batch(50, lengths)
    aux = torch.randn(len(lengths), max(lengths), 3 * 64)
    probs = torch.softmax(torch.randn(len(lengths), max(lengths), 50), dim=-1)
    position_mask = attention_mask.bool()
    results = []
    for model in (draft, reference):
        loss, per_step, _ = ttt_loss(model, aux, ids, loss_mask, probs, position_mask, 4)
        loss.backward()
        with torch.no_grad():
            logits = model(aux, [shift_left(ids, k) for k in range(4)])
        results.append((loss, per_step, logits, {n: p.grad for n, p in model.named_parameters()
                                                  if p.grad is not None}))
    (loss, per_step, logits, grads), (ref_loss, ref_per_step, ref_logits, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_step, ref_per_step, rtol=1e-5, atol=1e-6)
    real = attention_mask.bool()  # padded slots carry no loss and may differ
    for step, ref_step in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(step[real], ref_step[real], rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _training_step_peak(config, tokens: int, attention) -> int:
    """Peak bytes of one 7-step TTT forward + backward over one row of `tokens` (CPU)."""
    torch.manual_seed(0)
    draft = Eagle3Draft(config, attention=attention)
    ids, _, loss_mask = random_micro_batch(config.vocab_size, (tokens,))
    aux = torch.randn(1, tokens, 3 * config.target_hidden_size)
    probs = torch.softmax(torch.randn(1, tokens, config.draft_vocab_size), dim=-1)
    with TensorMemoryProbe() as probe:
        loss, _, _ = ttt_loss(draft, aux, ids, loss_mask, probs, loss_mask.bool(), 7)
        loss.backward()
    return probe.peak


def test_training_memory_grows_linearly_with_sequence_length():
    # A small width with 8 heads, where attention scores dominate a materialised step.
    config = DraftConfig(hidden_size=128, target_hidden_size=128, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=16, intermediate_size=256,
                         vocab_size=64, draft_vocab_size=64)
    growth = {}
    for name, attention in (("linear", ttt_attention), ("materialised", reference_ttt_attention)):
        growth[name] = (_training_step_peak(config, 1024, attention)
                        / _training_step_peak(config, 256, attention))
    assert growth["linear"] <= 4.6, growth  # 4x the tokens: about 4x the memory
    # The control: the materialised scores grow with S**2 and the probe sees it.
    assert growth["materialised"] >= 8, growth
