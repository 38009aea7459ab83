"""The supervision cache's format: written then read gives the same batches, in shards, split
between workers, and a cache from another target or other aux ids is refused. (Writing one with
the pool and training from it: tests/train/test_train.py.)"""

import pytest
import torch

from eagle_ray.config import ConfigError, PoolConfig
from eagle_ray.contract.fp8 import ROUND_TRIP_BOUND
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.supervision_cache import SupervisionCache, SupervisionCacheWriter
from eagle_ray.testing import random_micro_batch


@pytest.fixture(scope="module")
def written(hf_llama, llama_path, tmp_path_factory):
    """Eight micro-batches of the tiny target, cached as-is and as fp8, in small shards."""
    served = TargetIdentity.of_backend(hf_llama, str(llama_path))
    batches = [hf_llama.generate_batch(*random_micro_batch(hf_llama.vocab_size, lengths, seed=i))
               for i, lengths in enumerate([(17, 9, 30, 4), (64,), (5, 40, 12)] * 3)][:8]
    vocab = DraftVocab.from_token_counts(torch.arange(hf_llama.vocab_size), 100)
    caches = {}
    for encoding_dtype in ("auto", "fp8"):
        path = tmp_path_factory.mktemp(encoding_dtype)
        writer = SupervisionCacheWriter(path, served, encoding_dtype, shard_bytes=100_000)
        for batch in batches:
            writer.add(batch)
        writer.close(vocab, [[{"role": "user", "content": "hi"}]], {"kept": 8})
        caches[encoding_dtype] = SupervisionCache.open(path)
    return batches, caches, vocab


def test_written_then_read_gives_the_same_batches(written):
    batches, caches, vocab = written
    cache = caches["auto"]
    assert len(cache) == 8 and len(cache.index["shards"]) > 1, "several shards"
    for key, batch in enumerate(batches):
        back = cache.read(key)
        assert back.tensors().keys() == batch.tensors().keys()
        for name, tensor in batch.tensors().items():
            assert torch.equal(back.tensors()[name], tensor), (key, name)
    assert torch.equal(cache.draft_vocab.draft_to_target, vocab.draft_to_target)
    assert cache.index["held_out"] == [[{"role": "user", "content": "hi"}]]


def test_an_fp8_cache_is_a_quarter_of_fp32_and_within_the_format_bound(written):
    batches, caches, _ = written
    assert caches["fp8"].index["bytes"] < 0.3 * caches["auto"].index["bytes"]
    relative, _ = ROUND_TRIP_BOUND
    for key, batch in enumerate(batches):
        back = caches["fp8"].read(key)
        assert back.aux_hidden_states.dtype == torch.float32
        assert torch.equal(back.input_ids, batch.input_ids)
        error = (back.last_hidden - batch.last_hidden).abs()
        scale = batch.last_hidden.abs().amax(-1, keepdim=True) / 448
        assert (error <= relative * batch.last_hidden.abs() + scale * 2**-10 + 1e-7).all()


def test_workers_stream_disjoint_shares_every_epoch_in_a_seeded_order(written):
    _, caches, _ = written
    cache = caches["auto"]

    def ids(stream, count):
        return [int(next(stream).input_ids.sum()) for _ in range(count)]
    by_key = {int(cache.read(k).input_ids.sum()): k for k in range(len(cache))}
    first, second = ids(cache.stream(0, 2, seed=1), 8), ids(cache.stream(1, 2, seed=1), 8)
    keys = [{by_key[i] for i in part[:4]} for part in (first, second)]
    assert keys == [{0, 2, 4, 6}, {1, 3, 5, 7}]
    assert first[:4] != first[4:], "each epoch in a new order"
    assert sorted(first[:4]) == sorted(first[4:]), "of the same micro-batches"
    assert ids(cache.stream(0, 2, seed=1), 8) == first, "seeded"
    with pytest.raises(RuntimeError, match="fewer than the 9 workers"):
        next(cache.stream(8, 9))


def test_a_cache_from_another_target_or_other_aux_ids_is_refused(written, qwen3_path, tmp_path):
    _, caches, _ = written
    cache = caches["auto"]
    cache.check_target(PoolConfig())  # unset settings adopt the cache's target
    with pytest.raises(ConfigError, match="is another checkpoint"):
        cache.check_target(PoolConfig(model_path=str(qwen3_path)))
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        cache.check_target(PoolConfig(aux_layer_ids=[0, 1, 2]))
    with pytest.raises(ConfigError, match="eagle-ray cache"):
        SupervisionCache.open(tmp_path)
    with pytest.raises(FileExistsError):
        SupervisionCacheWriter(cache.path, cache.identity)
