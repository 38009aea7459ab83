"""P-EAGLE (eagle_ray/draft/peagle.py): its training forward against an independent computation
of what vLLM runs when it drafts in parallel, with a control; its export; training on the kit.
The job end to end (vLLM serving it with `parallel_drafting`): tests/train/test_train.py."""

import json
import math

import pytest
import torch
from kit_helpers import counting_forwards, perturbed_kind_draft, train_draft_on_random_rows

from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.draft.export import export_draft, load_exported_draft, validate_export
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, rotate
from eagle_ray.draft.peagle import PEagleDraft, resolve_mask_token_id
from eagle_ray.testing import random_micro_batch

MASK = 0  # the kit's pad token: no text uses it


@pytest.fixture(scope="module", params=[1, 2], ids=["1-layer", "2-layer"])
def setup(hf_llama, request):
    return hf_llama, *perturbed_kind_draft(hf_llama, "peagle", request.param, MASK)


def causal_attention(attn, x: torch.Tensor, c: DraftConfig) -> torch.Tensor:
    """Plain causal softmax attention over one sequence `x [1, n, width]`, positions 0..n-1."""
    n = x.shape[1]

    def heads(proj, count):
        return proj(x).view(1, n, count, c.head_dim).transpose(1, 2)
    positions = torch.arange(n)[None]
    q = rotate(heads(attn.q_proj, c.num_attention_heads), positions, c.rope_theta)
    k = rotate(heads(attn.k_proj, c.num_key_value_heads), positions, c.rope_theta)
    v = heads(attn.v_proj, c.num_key_value_heads)
    groups = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n, -1))


def vllm_parallel_draft_logits(draft: PEagleDraft, aux: torch.Tensor, tokens: list[int],
                               anchor: int, depth: int) -> torch.Tensor:
    """What vLLM's parallel drafting computes for mask slot `depth` after anchor `anchor`,
    written out independently: one causal pass over [the EAGLE-shifted context up to the anchor
    (token t + 1 with features fc(g_t)), then `depth` mask slots (the mask token, fc(mask_hidden))]
    at consecutive positions, through every layer (vLLM's llama_eagle3: the fused first, then
    plain pre-norm ones); the last slot's logits."""
    first, c = draft.midlayer, draft.config
    ids = tokens[:anchor + 1] + [draft.mask_token_id] * depth
    hidden = torch.cat([draft.fc(aux[:anchor + 1]),
                        draft.fc(draft.mask_hidden).expand(depth, -1)])[None]
    x = torch.cat([first.input_layernorm(draft.embed_tokens(torch.tensor(ids)))[None],
                   first.hidden_norm(hidden)], dim=-1)
    residual = hidden + causal_attention(first.self_attn, x, c)
    residual = residual + first.mlp(first.post_attention_layernorm(residual))
    for layer in draft.layers.values():
        residual = residual + causal_attention(layer.self_attn,
                                               layer.input_layernorm(residual), c)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
    return draft.lm_head(draft.norm(residual))[0, -1]


@torch.no_grad()
def test_each_training_slot_is_what_vllm_computes_for_that_mask_slot(setup):
    target, _, config, draft = setup
    assert len(draft.layers) == config.num_layers - 1
    batch = target.generate_batch(*random_micro_batch(target.vocab_size, (21,), seed=7))
    aux, tokens = batch.aux_hidden_states[0], batch.input_ids[0].tolist()
    depths = 4
    logits = draft(aux[None], draft.step_inputs(batch.input_ids, depths))
    checked = 0
    for anchor in (0, 5, 12, 19):
        for depth in range(depths):
            expected = vllm_parallel_draft_logits(draft, aux, tokens, anchor, depth)
            torch.testing.assert_close(logits[depth][0, anchor], expected, atol=1e-4, rtol=0)
            checked += 1
    assert checked == 16
    # The control: the same weights trained as an EAGLE-3 chain (step k reading step k - 1's
    # output and the ground truth) compute something else at every depth past the first.
    chain = Eagle3Draft.forward(draft, aux[None], Eagle3Draft.step_inputs(draft, batch.input_ids,
                                                                          depths))
    torch.testing.assert_close(chain[0], logits[0])
    for depth in range(1, depths):
        assert (chain[depth][0, 5] - logits[depth][0, 5]).abs().max() > 1e-2, depth


def test_proposing_is_one_pass_that_matches_the_training_slots(setup):
    target, vocab, _, draft = setup
    batch = target.generate_batch(*random_micro_batch(target.vocab_size, (12,), seed=2))
    seq = batch.input_ids[0].tolist()  # stands in for a verified sequence
    proposed, forwards = counting_forwards(draft, lambda: draft.propose(
        batch.aux_hidden_states[:, :11], [7] + seq[:10], seq[10], 4, vocab.draft_to_target))
    assert len(proposed) == 4 and forwards == 1, "all k tokens from one draft pass"


def test_the_objective_trains_and_the_export_is_what_vllm_reads(setup, llama_path, tmp_path):
    target, vocab, config, _ = setup
    torch.manual_seed(0)
    draft = PEagleDraft(config, MASK, target.get_input_embeddings().weight.detach())
    first = draft.mask_hidden.detach().clone()
    losses = train_draft_on_random_rows(target, draft, vocab, depth=3)
    assert losses[-1] < 0.7 * losses[0]
    assert not torch.equal(draft.mask_hidden, first), "mask_hidden is learned"
    served = TargetIdentity.of_backend(target, str(llama_path))
    out = export_draft(draft, vocab, served, tmp_path / "draft", ttt_steps=3)
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["mask_token_id"] == MASK and config_json["num_aux_hidden_states"] == 3
    assert config_json["eagle_ray_draft_kind"] == "peagle"
    assert config_json["num_hidden_layers"] == config.num_layers
    back, _ = load_exported_draft(out, target.get_input_embeddings().weight.detach())
    assert isinstance(back, PEagleDraft) and torch.equal(back.mask_hidden, draft.mask_hidden)
    assert len(back.layers) == len(draft.layers)
    # The controls: what vLLM would load silently wrong is refused.
    (out / "config.json").write_text(json.dumps({**config_json, "num_aux_hidden_states": 2}))
    with pytest.raises(ValueError, match="num_aux_hidden_states 2"):
        validate_export(out, served)
    (out / "config.json").write_text(json.dumps({**config_json, "mask_token_id": 10**6}))
    with pytest.raises(ValueError, match="mask_token_id 1000000"):
        validate_export(out, served)


def test_the_mask_token_is_a_free_id_else_the_pad_token(hf_llama):
    class Tokenizer:
        pad_token_id = 0

        def __init__(self, size):
            self.size = size

        def __len__(self):
            return self.size
    assert resolve_mask_token_id(None, Tokenizer(600), 640) == 600  # room past the tokenizer
    assert resolve_mask_token_id(None, Tokenizer(640), 640) == 0  # none: the pad token
    assert resolve_mask_token_id(17, Tokenizer(640), 640) == 17
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        resolve_mask_token_id(640, Tokenizer(640), 640)
