"""Embedding and head come straight from safetensors: single files, shards, tied embeddings."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_ray.contract.checkpoint import load_embedding_and_head
from eagle_ray.tiny import tiny_target_config


@pytest.mark.parametrize(("tied", "shard"), [(False, None), (True, None), (False, "200KB")])
def test_embedding_and_head_match_the_full_model(tmp_path, tied, shard):
    config = tiny_target_config("llama", vocab_size=300, num_layers=8)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if shard:
        model.save_pretrained(tmp_path, max_shard_size=shard)
        assert (tmp_path / "model.safetensors.index.json").exists()
    else:
        model.save_pretrained(tmp_path)
    embedding, head = load_embedding_and_head(tmp_path, torch.float32)
    assert torch.equal(embedding.weight, model.get_input_embeddings().weight)
    assert (head.lm_head.weight is embedding.weight) == tied
    hidden = torch.randn(3, 5, config.hidden_size)
    with torch.no_grad():
        expected = model.lm_head(model.model.norm(hidden))
        assert torch.equal(head(hidden), expected)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    tiny_target_config("llama", vocab_size=300).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_embedding_and_head(tmp_path, torch.float32)
