"""DFlash (eagle_ray/draft/dflash.py): its training forward and loss against an independent
computation of what vLLM's DFlash proposer runs, with controls; one-pass proposing; its export.
The job end to end (vLLM serving it with the `dflash` method): tests/train/test_train.py."""

import json
import math

import pytest
import torch
from kit_helpers import counting_forwards, perturbed_kind_draft, train_draft_on_random_rows

from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.losses import SlotLoss
from eagle_ray.contract.supervision import draft_target
from eagle_ray.draft.dflash import BlockWeighting, DFlashDraft, default_decay_gamma, sample_anchors
from eagle_ray.draft.export import export_draft, load_exported_draft, validate_export
from eagle_ray.draft.model import rotate
from eagle_ray.testing import random_micro_batch

from loss_oracles import dpace_block_weights, slot_value, softmax

MASK = 0  # the kit's pad token: no text uses it


@pytest.fixture(scope="module", params=[1, 2], ids=["1-layer", "2-layer"])
def setup(hf_llama, request):
    return hf_llama, *perturbed_kind_draft(hf_llama, "dflash", request.param, MASK)


def vllm_block_logits(draft: DFlashDraft, aux: torch.Tensor, tokens: list[int], anchor: int,
                      k: int, causal: bool = False, context_end: int | None = None
                      ) -> torch.Tensor:
    """What vLLM's DFlash proposer computes for one block, written out: the context
    `hidden_norm(fc(aux))` of slots 0..anchor projected by each layer into keys (`k_norm`, RoPE
    at 0..anchor) and values; the block [token, mask x k] at positions anchor + 1 ... through
    full Qwen3 layers whose queries attend to the context and the whole block (non-causal);
    logits `[1 + k, V_draft]`. `causal` / `context_end`: the controls' changes."""
    c = draft.config
    end = anchor + 1 if context_end is None else context_end
    context = draft.hidden_norm(draft.fc(aux[:end]))[None]
    block = torch.tensor([tokens[anchor]] + [draft.mask_token_id] * k)
    hidden = draft.embed_tokens(block)[None]
    context_positions, positions = torch.arange(end)[None], anchor + 1 + torch.arange(k + 1)[None]
    groups = c.num_attention_heads // c.num_key_value_heads
    for layer in draft.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)

        def heads(source, proj, count, norm=None):
            out = proj(source).view(1, source.shape[1], count, c.head_dim)
            return (norm(out) if norm else out).transpose(1, 2)
        q = rotate(heads(x, attn.q_proj, c.num_attention_heads, attn.q_norm), positions,
                   c.rope_theta)
        keys = torch.cat([
            rotate(heads(context, attn.k_proj, c.num_key_value_heads, attn.k_norm),
                   context_positions, c.rope_theta),
            rotate(heads(x, attn.k_proj, c.num_key_value_heads, attn.k_norm), positions,
                   c.rope_theta)], dim=2).repeat_interleave(groups, 1)
        values = torch.cat([heads(context, attn.v_proj, c.num_key_value_heads),
                            heads(x, attn.v_proj, c.num_key_value_heads)],
                           dim=2).repeat_interleave(groups, 1)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(c.head_dim)
        if causal:
            allowed = torch.ones(k + 1, end + k + 1, dtype=torch.bool).tril(end)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out = (scores.softmax(-1) @ values).transpose(1, 2).reshape(1, k + 1, -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return draft.lm_head(draft.norm(hidden))[0]


def kit_batch(target, lengths=(21,), seed=7):
    return target.generate_batch(*random_micro_batch(target.vocab_size, lengths, seed=seed))


@torch.no_grad()
def test_each_training_block_is_what_vllm_computes_for_that_block(setup):
    target, _, config, draft = setup
    assert len(draft.layers) == config.num_layers
    batch = kit_batch(target)
    aux, tokens = batch.aux_hidden_states[0], batch.input_ids[0].tolist()
    anchors = torch.tensor([[0, 5, 12, 19]])
    size = 4
    block = torch.full((1, 4, size), MASK)
    block[..., 0] = batch.input_ids.gather(1, anchors)
    logits = draft(aux[None], anchors, block)  # the four blocks in one masked pass
    for i, anchor in enumerate(anchors[0].tolist()):
        expected = vllm_block_logits(draft, aux, tokens, anchor, size - 1)
        torch.testing.assert_close(logits[0, i], expected, atol=1e-4, rtol=0)
        # The controls: a causal block, or a context that also holds the bonus token's own
        # target states (which vLLM does not have yet), compute something else.
        for control in (dict(causal=True), dict(context_end=anchor + 2)):
            other = vllm_block_logits(draft, aux, tokens, anchor, size - 1, **control)
            assert (other[1:] - logits[0, i, 1:]).abs().max() > 1e-3, (anchor, control)


def independent_loss(draft, batch, probs, position_mask, depth, name="forward_kl",
                     dpace_alpha=None):
    """The references' weighted mean, slot by slot: every anchor b (its token an answer token)
    and block slot j, scored with loss `name` against the target at slot b + j - 1 where token
    b + 1 + j is an answer token, weighted exp(-(j - 1) / gamma). With `dpace_alpha`: D-PACE's
    weights (Eq. 8 over the block, from the draft's probability of the target's top token),
    the weighted sum over the supervised slots' count."""
    gamma = default_decay_gamma(depth + 1)
    total = weights = 0.0
    rows, seq = batch.input_ids.shape
    for row in range(rows):
        aux, tokens = batch.aux_hidden_states[row], batch.input_ids[row].tolist()
        for b in range(seq):
            if not (batch.loss_mask[row, b] and position_mask[row, b]):
                continue
            logits = vllm_block_logits(draft, aux, tokens, b, depth)
            valid, values, confidences = [], [], []
            for j in range(1, depth + 1):
                valid.append(b + j < seq and bool(batch.loss_mask[row, b + j])
                             and bool(position_mask[row, b + j - 1]))
                target = probs[row, min(b + j - 1, seq - 1)]
                values.append(slot_value(name, logits[j].tolist(), target.tolist()))
                confidences.append(softmax(logits[j].tolist())[int(target.argmax())])
            decay = [math.exp(-(j - 1) / gamma) for j in range(1, depth + 1)]
            slot_weights = (decay if dpace_alpha is None
                            else dpace_block_weights(confidences, valid, dpace_alpha))
            for keep, value, weight, factor in zip(valid, values, slot_weights, decay,
                                                   strict=True):
                if keep:
                    total += weight * value
                    weights += factor if dpace_alpha is None else 1
    return total / weights


@torch.no_grad()
def test_the_objective_is_the_references_weighted_block_loss(setup):
    target, vocab, _, draft = setup
    batch = kit_batch(target, (13, 9), seed=3)
    probs, position_mask = draft_target(batch, vocab, target.get_target_head())
    loss, per_depth, accuracy = draft.objective(draft, batch.aux_hidden_states, batch.input_ids,
                                                batch.loss_mask, probs, position_mask, 3)
    assert per_depth.shape == accuracy.shape == (3,)
    expected = independent_loss(draft, batch, probs, position_mask, 3)
    assert abs(float(loss) - expected) < 1e-4, (float(loss), expected)
    # The control: targets one slot later (the EAGLE-3 step's) give another loss.
    later = torch.cat([probs[:, 1:], torch.zeros_like(probs[:, :1])], dim=1)
    assert abs(independent_loss(draft, batch, later, position_mask, 3) - expected) > 1e-2


@pytest.mark.parametrize(("name", "weighting"), [
    ("reverse_kl", "decay"), ("jensen_shannon", "dpace"), ("forward_kl", "dpace"),
    ("lk_hybrid", "dpace")])
@torch.no_grad()
def test_each_loss_and_d_pace_are_the_block_loss_computed_slot_by_slot(setup, name, weighting):
    target, vocab, _, draft = setup
    batch = kit_batch(target, (13, 9), seed=4)
    probs, position_mask = draft_target(batch, vocab, target.get_target_head())
    alpha = 0.4 if weighting == "dpace" else None
    original = draft.weighting
    try:
        draft.weighting = BlockWeighting(weighting, dpace_alpha=0.4)
        loss = draft.objective(draft, batch.aux_hidden_states, batch.input_ids,
                               batch.loss_mask, probs, position_mask, 3, loss=SlotLoss(name))[0]
    finally:
        draft.weighting = original
    expected = independent_loss(draft, batch, probs, position_mask, 3, name, alpha)
    assert abs(float(loss) - expected) < 1e-4, (float(loss), expected)
    # The control: the other weighting of the same slots' losses.
    other = independent_loss(draft, batch, probs, position_mask, 3, name,
                             None if alpha else 0.4)
    assert abs(other - expected) > 1e-2


def test_anchors_are_answer_slots_drawn_up_to_the_limit():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]])
    position_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    anchors, kept = sample_anchors(loss_mask, position_mask, 8)
    assert anchors[0][kept[0]].tolist() == [2, 3, 4] and anchors[1][kept[1]].tolist() == [1, 2]
    torch.manual_seed(0)
    drawn = {tuple(sample_anchors(loss_mask, position_mask, 2)[0][0].tolist())
             for _ in range(30)}
    assert drawn == {(2, 3), (2, 4), (3, 4)}, "two of the three, uniformly, ascending"


def test_proposing_is_one_pass_that_matches_the_training_block(setup):
    target, vocab, _, draft = setup
    batch = kit_batch(target, (12,), seed=2)
    seq = batch.input_ids[0].tolist()
    proposed, forwards = counting_forwards(draft, lambda: draft.propose(
        batch.aux_hidden_states[:, :11], [7] + seq[:10], seq[10], 4, vocab.draft_to_target))
    assert forwards == 1, "all k tokens from one draft pass"
    with torch.no_grad():
        expected = vllm_block_logits(draft, batch.aux_hidden_states[0], seq, 10, 4)
    assert proposed == expected[1:].argmax(-1).tolist()


def test_the_objective_trains_and_the_export_is_what_vllm_reads(setup, llama_path, tmp_path):
    target, vocab, config, _ = setup
    torch.manual_seed(0)
    draft = DFlashDraft(config, MASK, target.get_input_embeddings().weight.detach())
    losses = train_draft_on_random_rows(target, draft, vocab, depth=3)
    assert losses[-1] < 0.7 * losses[0]
    served = TargetIdentity.of_backend(target, str(llama_path))
    out = export_draft(draft, vocab, served, tmp_path / "draft", ttt_steps=3)
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["architectures"] == ["DFlashDraftModel"]
    assert config_json["dflash_config"] == {"mask_token_id": MASK,
                                            "target_layer_ids": list(served.aux_layer_ids)}
    assert "eagle_aux_hidden_state_layer_ids" not in config_json  # it would override them
    back, _ = load_exported_draft(out, target.get_input_embeddings().weight.detach())
    assert isinstance(back, DFlashDraft) and len(back.layers) == config.num_layers
    torch.testing.assert_close(back.state_dict(), draft.state_dict())
    # The controls: what vLLM would load silently wrong, or refuse, is refused here.
    (out / "config.json").write_text(json.dumps(
        {**config_json, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 1, 2]}}))
    with pytest.raises(ValueError, match="target_layer_ids"):
        validate_export(out, served)
    (out / "config.json").write_text(json.dumps(config_json))
    from safetensors.torch import load_file, save_file
    weights = load_file(str(out / "model.safetensors"))
    save_file({**weights, "mask_hidden": torch.zeros(1, 3 * config.hidden_size)},
              str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="mask_hidden"):
        validate_export(out, served)
