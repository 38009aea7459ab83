"""Out of memory after the engine (issue 52, item 6): in the host stage (self-check logits, head
decoding, host buffers) and in the fp8 encoding, it is the micro-batch's error, as in the engine
stage: a merged call's micro-batches run again one by one, only the one too large fails with
`MicroBatchOutOfMemory`, the others get their supervision and the queue goes on."""

import pytest
import torch

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.pool import replica
from eagle_ray.pool.engine_queue import EngineQueue
from eagle_ray.pool.protocol import MicroBatchOutOfMemory
from eagle_ray.testing import random_micro_batch

LIMIT = 30  # the host stage runs out of memory on a call of more tokens


@pytest.fixture(scope="module")
def hf_target(llama_path):
    return HFEagle3TargetModel.from_pretrained(llama_path, dtype=torch.float32)


class HostStageOutOfMemory:
    """The HF backend's two stages; its host stage fails as CUDA does above `limit` tokens."""

    def __init__(self, target, limit: int | None) -> None:
        self.target, self.limit, self.engine_calls = target, limit, []

    def run_engine(self, micro_batch):
        tokens = int(micro_batch[1].sum())
        self.engine_calls.append(tokens)
        return tokens, self.target.run_engine(*micro_batch)

    def finish(self, engine_output):
        tokens, output = engine_output
        if self.limit is not None and tokens > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB "
                                         f"(a host stage of {tokens} tokens)")
        return self.target.finish_batch(output)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-thread"])
@pytest.mark.parametrize("fault", [True, False], ids=["fault", "control"])
def test_out_of_memory_in_the_host_stage_fails_only_the_micro_batch_too_large(
        hf_target, pipelined, fault):
    stages = HostStageOutOfMemory(hf_target, LIMIT if fault else None)
    queue = EngineQueue(stages.run_engine, stages.finish, lambda call: call(),
                        max_tokens=1 << 20, pipelined=pipelined)
    parts = [random_micro_batch(hf_target.vocab_size, lengths, seed=i)
             for i, lengths in enumerate([(8,), (40,), (5, 7)])]
    answers = queue.generate_many(parts)
    if fault:  # merged (60 tokens) out of memory, then each alone: 8, 40 (out of memory), 12
        assert stages.engine_calls == [60, 8, 40, 12]
        assert isinstance(answers[1], MicroBatchOutOfMemory), answers[1]
        assert "40 tokens" in str(answers[1]) and "max_tokens_per_micro_batch" in str(answers[1])
        served = [0, 2]
    else:  # the control: one merged call serves all three
        assert stages.engine_calls == [60]
        served = [0, 1, 2]
    for i in served:
        torch.testing.assert_close(answers[i].aux_hidden_states,
                                   hf_target.generate_batch(*parts[i]).aux_hidden_states,
                                   rtol=1e-5, atol=1e-5)
    (after,) = queue.generate_many([random_micro_batch(hf_target.vocab_size, (9,), seed=9)])
    assert after.aux_hidden_states.shape[1] == 9, "the queue goes on"


def test_out_of_memory_in_the_fp8_encoding_is_the_micro_batchs_error(hf_target, monkeypatch):
    micro_batch = random_micro_batch(hf_target.vocab_size, (11, 6), seed=3)
    batch = hf_target.generate_batch(*micro_batch)
    assert isinstance(replica.encode_answer(batch, "fp8", micro_batch), dict)  # the control

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
    monkeypatch.setattr(replica, "batch_to_numpy", out_of_memory)
    answer = replica.encode_answer(batch, "fp8", micro_batch)
    assert isinstance(answer, MicroBatchOutOfMemory)
    assert "17 tokens (2 rows x 11 padded positions)" in str(answer)

    def broken(*args):
        raise ValueError("not a memory error")
    monkeypatch.setattr(replica, "batch_to_numpy", broken)
    with pytest.raises(ValueError, match="not a memory error"):  # anything else is not caught
        replica.encode_answer(batch, "fp8", micro_batch)
