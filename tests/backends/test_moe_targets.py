"""Mixture-of-experts targets on the real CPU vLLM engine equal the HF reference on every slot:
Qwen3-MoE (padded vocabulary), Mixtral (EAGLE-3 through eagle_ray's vLLM plugin, served from a
weights-only folder) and gpt-oss (sliding-window layers, attention sinks). DeepSeek-V2's latent
attention runs on the HF backend only (docs/backends.md, "Targets"):
tests/backends/test_hf_target.py.
"""

import shutil

import pytest
import torch

from eagle_ray.backends.base import Sampling
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel
from eagle_ray.data.tokenizer_files import has_tokenizer_files
from eagle_ray.testing import random_micro_batch

from reference_checks import FP32_ATOL, assert_matches_reference

pytestmark = pytest.mark.slow

WEIGHTS_ONLY = {"mixtral"}  # served from a folder with config.json and safetensors only
# Compiled as on a GPU: Mixtral's capture is eagle_ray's own model class (the vLLM plugin), which
# must be the class vLLM compiles, or the compiled forward returns no aux states.
COMPILED = {"mixtral"}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def moe_target(request, family_checkpoints, tmp_path_factory):
    """The family's engine (multiprocess, 64-token prefill chunks; `COMPILED` ones compiled) and
    its HF reference."""
    family = request.param
    path = family_checkpoints[family]
    if family in WEIGHTS_ONLY:
        weights_only = tmp_path_factory.mktemp(f"{family}-weights-only")
        for name in ("config.json", "model.safetensors"):
            shutil.copy(path / name, weights_only / name)
        path = weights_only
    target = VLLMEagle3TargetModel.from_pretrained(
        path, dtype="float32", multiprocess=True,
        vllm_kwargs={"max_num_batched_tokens": 64, "max_num_seqs": 8,
                     "enforce_eager": family not in COMPILED})
    yield family, target, HFEagle3TargetModel.from_pretrained(path, dtype=torch.float32)
    target.shutdown()


def test_moe_target_equals_hf_on_every_slot(moe_target):
    family, target, reference = moe_target
    compiled = target.runner.llm.llm_engine.vllm_config.compilation_config.mode.name != "NONE"
    assert compiled == (family in COMPILED)
    head = reference.get_target_head()
    # Mixed lengths, and rows up to the longest the engine takes, split into 64-token chunks.
    for lengths in ((17, 9, 30, 4), (target.max_length, 130, 65)):
        batch_args = random_micro_batch(target.vocab_size, lengths, seed=sum(lengths))
        assert_matches_reference(target.generate_batch(*batch_args),
                                 reference.generate_batch(*batch_args), head)
        logits = target.generate_batch(*batch_args, encoding="logits").logits
        expected = reference.generate_batch(*batch_args, encoding="logits").logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=FP32_ATOL)


def test_moe_target_generates_the_hf_greedy_answer(moe_target):
    """What regeneration asks of a replica: token ids in, token ids out (no tokenizer needed,
    so a weights-only folder regenerates too)."""
    family, target, reference = moe_target
    prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3]]
    sampling = Sampling(max_new_tokens=6)
    assert target.complete(prompts, sampling) == reference.complete(prompts, sampling)
    if family in WEIGHTS_ONLY:
        model_config = target.runner.llm.llm_engine.model_config
        assert not has_tokenizer_files(model_config.model) and model_config.skip_tokenizer_init
