"""The vLLM backend on a real (CPU) vLLM engine equals the HF reference.

Engines are expensive (10-25 s each on 2 cores): one in-process Llama engine for the module, run
compiled as on a GPU (torch.compile; CUDA graphs are the GPU's alone), and module-scoped
multiprocess engines, eager, for the cases that need their own configuration.
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from eagle_ray.backends.base import RunnerEagle3TargetModel, SelfCheckError, check_ranks_agree
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.backends.vllm import runner as runner_module
from eagle_ray.backends.vllm.handoff import SHM_DIR, InProcessHandoff, ShmRingHandoff, ring_name
from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.testing import random_micro_batch

from reference_checks import assert_matches_reference

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def vllm_llama(llama_path):
    """Compiled, as vLLM runs on a GPU (`enforce_eager` is the CPU default's, not vLLM's)."""
    target = VLLMEagle3TargetModel.from_pretrained(llama_path, dtype="float32",
                                                   vllm_kwargs={"enforce_eager": False})
    yield target
    target.shutdown()


def test_the_llama_engine_under_test_is_compiled(vllm_llama):
    from vllm.config import CompilationMode

    config = vllm_llama.runner.llm.llm_engine.vllm_config.compilation_config
    assert config.mode is not CompilationMode.NONE, config.mode


FIVE_AUX_LAYERS = [0, 1, 3, 4, 5]  # more than EAGLE-3's three, as a DFlash draft reads


@pytest.fixture(scope="module")
def padded_qwen3(family_checkpoints):
    """The Qwen3-shaped checkpoint (vocabulary padded past its tokenizer) on a multiprocess engine
    (shared-memory hand-off) that splits prompts into 64-token prefill chunks, capturing five
    aux layers, and its HF reference on the same layers."""
    path = family_checkpoints["qwen3"]
    target = VLLMEagle3TargetModel.from_pretrained(
        path, aux_layer_ids=FIVE_AUX_LAYERS, dtype="float32", multiprocess=True,
        vllm_kwargs={"max_num_batched_tokens": 64, "max_num_seqs": 8})
    yield target, HFEagle3TargetModel.from_pretrained(path, aux_layer_ids=FIVE_AUX_LAYERS,
                                                      dtype=torch.float32)
    target.shutdown()


@pytest.mark.parametrize("lengths", [(17, 9, 30, 4), (1, 64), (33,)])
def test_llama_equals_hf_on_mixed_length_batches(vllm_llama, hf_llama, lengths):
    batch_args = random_micro_batch(vllm_llama.vocab_size, lengths, seed=sum(lengths))
    batch = vllm_llama.generate_batch(*batch_args)
    reference = hf_llama.generate_batch(*batch_args)
    assert_matches_reference(batch, reference, hf_llama.get_target_head())


def test_padded_vocabulary_qwen3_equals_hf(padded_qwen3, family_checkpoints):
    target, reference = padded_qwen3
    tokenizer_size = len(AutoTokenizer.from_pretrained(family_checkpoints["qwen3"]))
    assert target.vocab_size == 1088 > tokenizer_size
    batch_args = random_micro_batch(target.vocab_size, (12, 40, 7), seed=5)
    assert int(batch_args[0].max()) >= tokenizer_size, "ids in the padded range are served too"
    batch = target.generate_batch(*batch_args)
    assert batch.num_aux_layers == len(FIVE_AUX_LAYERS) == 5  # every slot compared below
    assert batch.aux_hidden_states.shape[-1] == 5 * batch.last_hidden.shape[-1]
    assert_matches_reference(batch, reference.generate_batch(*batch_args),
                             reference.get_target_head())


def test_rows_longer_than_a_prefill_chunk_equal_hf(padded_qwen3):
    target, reference = padded_qwen3
    # Up to the longest row the target accepts, each split into 64-token chunks by vLLM.
    lengths = (target.max_length, 130, 65)
    batch_args = random_micro_batch(target.vocab_size, lengths, seed=6)
    assert_matches_reference(target.generate_batch(*batch_args),
                             reference.generate_batch(*batch_args), reference.get_target_head())


def test_repeated_calls_give_the_same_result_and_leave_nothing_behind(vllm_llama):
    batch_args = random_micro_batch(vllm_llama.vocab_size, (20, 11))
    first = vllm_llama.generate_batch(*batch_args)
    for _ in range(3):
        again = vllm_llama.generate_batch(*batch_args)
        assert torch.equal(again.aux_hidden_states, first.aux_hidden_states)
    runner = vllm_llama.runner
    assert isinstance(runner.handoff, InProcessHandoff)
    assert runner.handoff.keys(runner.key_prefix) == []
    assert not runner.llm.llm_engine.engine_core.engine_core.scheduler.has_requests()


def test_multiprocess_handoff_goes_through_one_shared_memory_ring_and_cleans_up(padded_qwen3):
    target, _ = padded_qwen3
    runner = target.runner
    assert isinstance(runner.handoff, ShmRingHandoff) and runner.handoff.directory == SHM_DIR
    first = target.generate_batch(*random_micro_batch(target.vocab_size, (5, 9)))
    for _ in range(3):  # the ring's stretches are reused; results stay right
        again = target.generate_batch(*random_micro_batch(target.vocab_size, (5, 9)))
        assert torch.equal(again.aux_hidden_states, first.aux_hidden_states)
    leftovers = [f for f in os.listdir(SHM_DIR) if f.startswith(runner.key_prefix)]
    assert leftovers == [ring_name(runner.key_prefix)], "the ring alone, no request records"


def test_embedding_and_head_come_from_the_checkpoint(vllm_llama, hf_llama):
    assert torch.equal(vllm_llama.get_input_embeddings().weight,
                       hf_llama.get_input_embeddings().weight)
    head, reference = vllm_llama.get_target_head(), hf_llama.get_target_head()
    assert type(head.norm) is type(reference.norm)
    assert torch.equal(head.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(head.norm.weight, reference.norm.weight)


def test_tensor_parallel_two_with_one_aux_layer_equals_hf_and_sweeps_a_killed_ring(
        llama_path, hf_llama, monkeypatch):
    def ours():  # vLLM and torch keep their own entries there too
        return {name for name in os.listdir(SHM_DIR) if name.startswith("eagle_ray-")}
    before = ours()
    # A replica SIGKILLed with its engine up leaves its ring (named with its pid) behind ...
    subprocess.run([sys.executable, "-c", "import os; "
                    "from eagle_ray.backends.vllm.handoff import *; "
                    "choose_handoff('shm', same_process=False, key_prefix='eagle_ray-killed-'); "
                    "os.kill(os.getpid(), 9)"], check=False)
    assert len(ours() - before) == 1
    # ... and the next engine on the machine sweeps it.
    target = VLLMEagle3TargetModel.from_pretrained(llama_path, aux_layer_ids=[2],
                                                   dtype="float32", tp_size=2)
    assert ours() - before == {ring_name(target.runner.key_prefix)}
    try:
        # One aux layer (the fewest a draft can read), captured through both ranks.
        reference_backend = HFEagle3TargetModel(hf_llama.model, aux_layer_ids=[2])
        batch_args = random_micro_batch(target.vocab_size, (18, 6, 29))
        rank_checks = []

        def recorded(rank_zero, rows, rank, capture_id):
            rank_checks.append((rank_zero, rows, rank, capture_id))
            check_ranks_agree(rank_zero, rows, rank, capture_id)
        monkeypatch.setattr(runner_module, "check_ranks_agree", recorded)
        assert_matches_reference(target.generate_batch(*batch_args),
                                 reference_backend.generate_batch(*batch_args),
                                 hf_llama.get_target_head())
        # The self-check's cover of the aux layer: rank 1's own copy of it, compared.
        ((rank_zero, rows, rank, capture_id),) = rank_checks
        assert (rank, capture_id, tuple(rows.shape)) == (1, 3, (3, target.runner.hidden_size))
        torch.testing.assert_close(rows, rank_zero, rtol=0, atol=1e-6)
        assert target.runner.handoff.keys(target.runner.key_prefix) == [
            ring_name(target.runner.key_prefix)], "every request's states and rows taken"
        with pytest.raises(SelfCheckError, match="rank 1.*layer id 3"):  # a partial sum fails
            check_ranks_agree(rank_zero, rank_zero / 2, 1, 3)
    finally:
        target.shutdown()
    assert ours() - before == set(), "shutdown removes the ring"


def test_bfloat16_agrees_with_fp32_reference_within_bf16_precision(llama_path, hf_llama,
                                                                   monkeypatch):
    # As training images often set it: vLLM refuses KV connectors beside expandable_segments,
    # so the engine is started without it (and with the rest of the settings).
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    target = VLLMEagle3TargetModel.from_pretrained(llama_path, dtype="bfloat16",
                                                   multiprocess=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    try:
        batch_args = random_micro_batch(target.vocab_size, (40, 23, 31), seed=3)
        batch = target.generate_batch(*batch_args)
        reference = hf_llama.generate_batch(*batch_args)
        assert batch.aux_hidden_states.dtype == torch.bfloat16
        valid = reference.attention_mask.bool()
        cosine = torch.nn.functional.cosine_similarity(
            batch.aux_hidden_states.float(), reference.aux_hidden_states, dim=-1)[valid]
        assert cosine.min() > 0.99, f"aux cosine min {cosine.min():.4f}"
        has_next = valid.roll(-1, 1)
        has_next[:, -1] = False
        head = hf_llama.get_target_head()
        agree = (head(batch.last_hidden.float()).argmax(-1)
                 == head(reference.last_hidden).argmax(-1))[has_next].float().mean()
        assert agree > 0.9, f"bf16 argmax agreement {agree:.3f}"
    finally:
        target.shutdown()


def test_self_check_fires_when_capture_ids_are_off_by_one(llama_path, vllm_llama):
    from eagle_ray.backends.vllm.runner import VLLMTargetRunner

    ids = vllm_llama.aux_layer_ids
    n = vllm_llama.num_hidden_layers
    # The classic bug: canonical ids passed to vLLM untranslated, so "final" is layer N-1's input.
    runner = VLLMTargetRunner(str(llama_path), [*ids, n - 1], hidden_size=128,
                              dtype=torch.float32, multiprocess=True)
    try:
        wrong = RunnerEagle3TargetModel(
            runner, num_hidden_layers=n, vocab_size=vllm_llama.vocab_size, aux_layer_ids=ids,
            embedding=vllm_llama.get_input_embeddings(), head=vllm_llama.get_target_head())
        with pytest.raises(SelfCheckError, match="layer-id convention"):
            wrong.generate_batch(*random_micro_batch(vllm_llama.vocab_size, (12, 30, 21)))
    finally:
        runner.shutdown()


class TestBadInput:
    def test_ids_outside_vocabulary(self, vllm_llama):
        ids, attn, loss = random_micro_batch(vllm_llama.vocab_size, (5, 3))
        ids[0, 1] = vllm_llama.vocab_size + 7
        with pytest.raises(ValueError, match="target's vocabulary"):
            vllm_llama.generate_batch(ids, attn, loss)

    def test_row_longer_than_max_model_len(self, vllm_llama):
        n = vllm_llama.runner.max_model_len
        ids = torch.full((1, n), 5)
        with pytest.raises(ValueError, match=f"{n} tokens but the target accepts at most {n - 1}"):
            vllm_llama.generate_batch(ids, torch.ones_like(ids), torch.ones_like(ids))

    def test_empty_batch(self, vllm_llama):
        empty = torch.zeros(0, 4, dtype=torch.long)
        with pytest.raises(ValueError, match="empty micro-batch"):
            vllm_llama.generate_batch(empty, empty, empty)

    def test_wrong_dtype(self, vllm_llama):
        ids, attn, loss = random_micro_batch(vllm_llama.vocab_size, (5,))
        with pytest.raises(TypeError, match="integer token ids"):
            vllm_llama.generate_batch(ids.float(), attn, loss)

    def test_engine_keeps_serving_correctly_afterwards(self, vllm_llama, hf_llama):
        batch_args = random_micro_batch(vllm_llama.vocab_size, (14, 8), seed=11)
        assert_matches_reference(vllm_llama.generate_batch(*batch_args),
                                 hf_llama.generate_batch(*batch_args),
                                 hf_llama.get_target_head())


def test_engine_owned_kwargs_cannot_be_overridden(llama_path):
    with pytest.raises(ValueError, match="may not set.*speculative_config"):
        VLLMEagle3TargetModel.from_pretrained(
            llama_path, vllm_kwargs={"speculative_config": {"method": "eagle3"}})


def test_second_in_process_engine_is_refused(llama_path, vllm_llama):
    with pytest.raises(RuntimeError, match="already runs an in-process vLLM engine"):
        VLLMEagle3TargetModel.from_pretrained(llama_path, dtype="float32", multiprocess=False)


def test_head_is_a_target_head(vllm_llama):
    assert isinstance(vllm_llama.get_target_head(), TargetHead)
