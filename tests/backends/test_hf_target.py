import pytest
import torch

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.testing import random_micro_batch
from eagle_ray.tiny import MOE_ARCHITECTURES


@pytest.mark.parametrize("backend_name", ["hf_llama", "hf_qwen3"])
def test_aux_states_are_hf_hidden_states_after_each_layer(backend_name, request):
    target = request.getfixturevalue(backend_name)
    input_ids, attention_mask, loss_mask = random_micro_batch(target.vocab_size, (12, 12))
    batch = target.generate_batch(input_ids, attention_mask, loss_mask)
    with torch.inference_mode():
        reference = target.model(input_ids, attention_mask=attention_mask,
                                 output_hidden_states=True).hidden_states
    hidden = target.model.config.hidden_size
    for i, layer_id in enumerate(target.aux_layer_ids):
        captured = batch.aux_hidden_states[..., i * hidden : (i + 1) * hidden]
        assert torch.equal(captured, reference[layer_id + 1]), f"aux layer {layer_id}"


def test_last_hidden_decodes_to_the_models_own_logits(hf_llama):
    input_ids, attention_mask, loss_mask = random_micro_batch(hf_llama.vocab_size, (16,))
    batch = hf_llama.generate_batch(input_ids, attention_mask, loss_mask, encoding="logits")
    with torch.inference_mode():
        logits = hf_llama.model(input_ids).logits
    # Slot t carries the distribution at position t + 1; the last slot has none.
    torch.testing.assert_close(batch.logits[0, :-1], logits[0, 1:], rtol=0, atol=1e-5)
    assert torch.all(batch.logits[0, -1] == 0)


def test_padding_rows_do_not_change_unpadded_slots(hf_llama):
    lengths = (17, 9, 30, 4)
    input_ids, attention_mask, loss_mask = random_micro_batch(hf_llama.vocab_size, lengths)
    together = hf_llama.generate_batch(input_ids, attention_mask, loss_mask)
    for row, n in enumerate(lengths):
        alone = hf_llama.generate_batch(input_ids[row : row + 1, :n],
                                        attention_mask[row : row + 1, :n],
                                        loss_mask[row : row + 1, :n])
        for name, tensor in alone.tensors().items():
            torch.testing.assert_close(together.tensors()[name][row, :n], tensor[0],
                                       rtol=1e-5, atol=1e-5, msg=f"{name} of row {row}")
        assert torch.all(together.aux_hidden_states[row, n:] == 0)
        assert torch.all(together.loss_mask[row, n - 1 :] == 0)


def test_explicit_aux_ids_are_honoured(llama_path):
    target = HFEagle3TargetModel.from_pretrained(llama_path, aux_layer_ids=[0, 2, 5],
                                                 dtype=torch.float32)
    input_ids, attention_mask, loss_mask = random_micro_batch(target.vocab_size, (8,))
    batch = target.generate_batch(input_ids, attention_mask, loss_mask)
    with torch.inference_mode():
        reference = target.model(input_ids, output_hidden_states=True).hidden_states
    assert target.aux_layer_ids == [0, 2, 5]
    expected = torch.cat([reference[1], reference[3], reference[6]], dim=-1)
    assert torch.equal(batch.aux_hidden_states, expected)


def test_embedding_is_the_targets_own(hf_llama):
    assert hf_llama.get_input_embeddings() is hf_llama.model.get_input_embeddings()


@pytest.mark.parametrize("family", MOE_ARCHITECTURES)
def test_moe_targets_capture_hf_hidden_states_and_ignore_padding(family, family_checkpoints):
    """The HF backend on each mixture-of-experts shape (the only backend DeepSeek-V2's latent
    attention has on the CPU build): aux states are the model's own hidden states, and a row
    padded into a batch gets what it gets alone (routing is per token)."""
    target = HFEagle3TargetModel.from_pretrained(family_checkpoints[family], dtype=torch.float32)
    lengths = (13, 5)
    input_ids, attention_mask, loss_mask = random_micro_batch(target.vocab_size, lengths)
    batch = target.generate_batch(input_ids, attention_mask, loss_mask)
    hidden = target.model.config.hidden_size
    for row, n in enumerate(lengths):
        with torch.inference_mode():
            states = target.model(input_ids[row:row + 1, :n], output_hidden_states=True
                                  ).hidden_states
        expected = torch.cat([states[i + 1] for i in target.aux_layer_ids], dim=-1)[0]
        torch.testing.assert_close(batch.aux_hidden_states[row, :n], expected, rtol=1e-5,
                                   atol=1e-5, msg=f"row {row}")
        assert batch.aux_hidden_states.shape[-1] == 3 * hidden


def test_both_backends_take_the_path_then_keywords_only():
    """One `from_pretrained` contract: a positional second argument (once `device` on one
    backend and `tp_size` on the other) is refused on both."""
    import inspect

    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

    for backend in (HFEagle3TargetModel, VLLMEagle3TargetModel):
        parameters = list(inspect.signature(backend.from_pretrained).parameters.values())
        assert parameters[0].name == "model_path"
        assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters[1:]), backend
