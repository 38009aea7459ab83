"""Any number N >= 1 of captured layers (docs/contract.md, "Aux layer ids"): the batch says how
many it carries, keeps saying so across the object store (both encodings), the supervision
cache and device copies, and what travels grows by one hidden state per layer. EAGLE-3 jobs
still read exactly three. vLLM == HF on every slot at N = 1 and 5:
tests/backends/test_vllm_target.py."""

import pytest
import torch

from eagle_ray.backends.base import validate_aux_layer_ids, validate_eagle3_aux_layer_ids
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.pool.transport import batch_from_numpy, batch_to_numpy
from eagle_ray.testing import random_micro_batch

LAYER_SETS = ([3], [1, 3, 4], [0, 1, 3, 4, 5])


@pytest.fixture(scope="module")
def backends(hf_llama):
    return {len(ids): HFEagle3TargetModel(hf_llama.model, aux_layer_ids=ids)
            for ids in LAYER_SETS}


def test_any_count_is_a_valid_capture_and_eagle3_keeps_three():
    assert validate_aux_layer_ids([3], 8) == [3]
    assert validate_aux_layer_ids([0, 1, 3, 4, 5], 8) == [0, 1, 3, 4, 5]
    with pytest.raises(ValueError, match="at least one layer"):
        validate_aux_layer_ids([], 8)
    with pytest.raises(ValueError, match="EAGLE-3 needs exactly 3 aux layer ids, got 5"):
        validate_eagle3_aux_layer_ids([0, 1, 3, 4, 5], 8)


def test_each_layer_is_the_hf_hidden_state_it_names(backends, hf_llama):
    batch_args = random_micro_batch(hf_llama.vocab_size, (9, 14), seed=3)
    input_ids, attention_mask, _ = batch_args
    with torch.no_grad():
        states = hf_llama.model(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=True).hidden_states
    for ids in LAYER_SETS:
        batch = backends[len(ids)].generate_batch(*batch_args)
        hidden = batch.hidden_size
        assert batch.num_aux_layers == len(ids)
        assert batch.aux_hidden_states.shape[-1] == len(ids) * hidden
        for slot, layer in enumerate(ids):  # canonical id k: the output of decoder layer k
            got = batch.aux_hidden_states[..., slot * hidden:(slot + 1) * hidden]
            real = attention_mask.bool()
            torch.testing.assert_close(got[real], states[layer + 1][real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("encoding_dtype", ["auto", "fp8"])
def test_the_count_travels_and_the_wire_grows_by_one_state_per_layer(backends, hf_llama,
                                                                      encoding_dtype):
    batch_args = random_micro_batch(hf_llama.vocab_size, (12, 7), seed=4)
    sizes = {}
    for count, backend in backends.items():
        batch = backend.generate_batch(*batch_args)
        payload = batch_to_numpy(batch, encoding_dtype)
        back = batch_from_numpy(payload)
        assert back.num_aux_layers == count and back.to("cpu").num_aux_layers == count
        assert back.aux_hidden_states.shape == batch.aux_hidden_states.shape
        sizes[count] = sum(entry[0].nbytes + (entry[2].nbytes if len(entry) > 2 else 0)
                           for name, entry in payload.items() if name != "num_aux_layers")
    tokens, hidden = batch_args[0].numel(), batch.hidden_size
    # One more layer: H values per token (4 bytes in fp32, 1 in fp8 plus its 4-byte scale).
    per_layer = tokens * (hidden * 4 if encoding_dtype == "auto" else hidden + 4)
    assert sizes[5] - sizes[3] == 2 * per_layer and sizes[3] - sizes[1] == 2 * per_layer


def test_a_batch_whose_width_does_not_match_its_count_is_refused(backends, hf_llama):
    batch = backends[3].generate_batch(*random_micro_batch(hf_llama.vocab_size, (5,), seed=1))
    fields = batch.tensors()
    with pytest.raises(ValueError, match=r"aux_hidden_states' width / 2 aux layers"):
        Eagle3TargetBatch(**fields, num_aux_layers=2)  # 3H wide: not 2 layers of H
    with pytest.raises(ValueError, match="num_aux_layers must be a positive int"):
        Eagle3TargetBatch(**fields, num_aux_layers=0)
    assert Eagle3TargetBatch(**fields).num_aux_layers == 3  # EAGLE-3's, the default
