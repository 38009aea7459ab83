"""A draft trained beside a vision-language target trains on exactly what vLLM's proposer feeds
an EAGLE-3 Llama draft there (vllm/v1/spec_decode/llm_base_proposer.py): at an image position
the placeholder token's own embedding, and as positions the target's temporal M-RoPE index
(`_set_positions`: `positions[0]` for a draft whose config has no M-RoPE, which is what the
export writes)."""

from __future__ import annotations

import torch
from vision_helpers import GRIDS, image_rows, padded, tiny_vl_model, vllm_temporal_positions

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, chain_step_inputs


def _proposer_logits(draft: Eagle3Draft, row: list[int], aux: torch.Tensor,
                     positions: list[int], slot: int) -> torch.Tensor:
    """The draft's first forward as vLLM's proposer runs it for a request whose verified
    tokens end at `slot`: ids shifted left by one (`input_ids[:-1] = target_token_ids[1:]`),
    the target's states of tokens 0 .. slot, the given positions; logits at the last token."""
    ids = torch.tensor([row[1:slot + 2]])
    logits = draft(aux[None, :slot + 1], [ids], torch.tensor([positions[:slot + 1]]))[0]
    return logits[0, -1]


def test_training_slot_equals_the_proposers_draft_input():
    model = tiny_vl_model("qwen2_5_vl")
    config = model.config
    rows, images = image_rows(config, torch.Generator().manual_seed(5))
    ids, attention = padded(rows)
    batch = HFEagle3TargetModel(model).generate_batch(ids, attention, images=images)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(config, draft_vocab_size=64),
                        model.get_input_embeddings().weight)
    # The training forward over the whole padded micro-batch, step 0 (what TTT step 0 scores).
    training = draft(batch.aux_hidden_states, chain_step_inputs(batch.input_ids, 1),
                     batch.positions)[0]
    row = rows[0]
    merge = config.vision_config.spatial_merge_size
    vllm_positions = vllm_temporal_positions(row, GRIDS[0], config.image_token_id, merge)
    image_slots = [t for t, token in enumerate(row) if token == config.image_token_id]
    # slot t reads token t + 1: the last image slot but one reads a placeholder; the first slot
    # after the image's end marker reads text
    image_slot, text_slot = image_slots[-2], image_slots[-1] + 2
    assert row[image_slot + 1] == config.image_token_id != row[text_slot + 1]
    aux = batch.aux_hidden_states[0]
    for slot in (image_slot, text_slot):
        expected = _proposer_logits(draft, row, aux, vllm_positions, slot)
        torch.testing.assert_close(training[0, slot], expected, atol=1e-5, rtol=1e-5)
        # Control: positions 0 .. t (a text target's) give another distribution there.
        plain = _proposer_logits(draft, row, aux, list(range(len(row))), slot)
        assert (plain - expected).abs().amax() > 1e-4
    assert vllm_positions[text_slot] < text_slot  # the image's patches share one index
