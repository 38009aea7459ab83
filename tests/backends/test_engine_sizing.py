"""A job sizes its vLLM engines from the longest sequence it sends, not from the checkpoint's
`max_position_embeddings` (131,072 for Llama-3.1)."""

import json

import pytest

from eagle_ray.backends.sizing import check_rows_fit, longest_sequence, sized_pool_config
from eagle_ray.config import ConfigError, JobConfig, load_yaml
from eagle_ray.tiny import build_tiny_target


def tiny_job(*overrides: str) -> JobConfig:
    return load_yaml(JobConfig, "examples/tiny.yaml", list(overrides))


def test_the_longest_sequence_counts_rows_and_the_tokens_generated_after_them():
    job = tiny_job()  # rows of 256, regeneration of 64 new tokens, evaluation of 32
    assert longest_sequence(job) == 256 + 64
    assert sized_pool_config(job).vllm_kwargs["max_model_len"] == 256 + 64 + 1
    assert longest_sequence(tiny_job("regenerate.enabled=false")) == 256 + 32
    assert longest_sequence(tiny_job("regenerate.enabled=false", "eval.enabled=false")) == 256


def test_a_max_model_len_the_job_sets_and_other_backends_are_left_alone():
    explicit = tiny_job("target.vllm_kwargs.max_model_len=1024")
    assert sized_pool_config(explicit).vllm_kwargs == {"max_model_len": 1024}
    assert sized_pool_config(tiny_job("target.backend=hf")).vllm_kwargs == {}
    assert "max_model_len" not in tiny_job().target.vllm_kwargs  # the job's config unchanged


def test_a_shared_pool_with_shorter_rows_is_refused_with_both_numbers():
    job = tiny_job("use_shared_pool=true")
    check_rows_fit(job, 256)
    check_rows_fit(job, None)  # a backend without a limit
    with pytest.raises(ConfigError, match=r"data.max_length is 256 .* at most 200 .*"
                                          r"max_model_len >= 321"):
        check_rows_fit(job, 200)


@pytest.mark.slow
def test_a_llama_3_1_shaped_checkpoint_needs_the_job_sized_engine(tmp_path):
    """Sized from the checkpoint, the engine does not fit the CPU's KV budget; sized by the job
    it does (tests/train/test_train.py: the main job's pool, evaluation and regeneration serve
    the same Llama-3.1-shaped target with no vLLM option set)."""
    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

    path = build_tiny_target(tmp_path / "llama-3.1-shaped", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        VLLMEagle3TargetModel.from_pretrained(path, dtype="float32", multiprocess=True)
    sized = sized_pool_config(tiny_job(f"target.model_path={path}"))
    assert sized.vllm_kwargs == {"max_model_len": 256 + 64 + 1}
