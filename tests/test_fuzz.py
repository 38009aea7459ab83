"""Hostile input, generated: every bad micro-batch or config is a clear error of the documented
kind (never a crash, never another exception), and good input still works after it."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_ray.config import ConfigError, JobConfig, from_dict
from eagle_ray.target_batch import validate_micro_batch

from fuzz_inputs import hostile_micro_batches

VOCAB, MAX_LENGTH = 1024, 64


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_micro_batches(VOCAB, MAX_LENGTH))
def test_hostile_micro_batches_are_refused_with_a_clear_error_or_accepted(batch):
    try:
        validate_micro_batch(*batch, vocab_size=VOCAB, max_length=MAX_LENGTH)
    except (TypeError, ValueError) as e:
        assert len(str(e)) > 20, f"an error that says what was wrong: {e!r}"


@settings(max_examples=200, deadline=None)
@given(hostile_micro_batches(1536, 512))
def test_the_hf_backend_refuses_or_serves_and_keeps_serving(hf_llama, batch):
    try:
        result = hf_llama.generate_batch(*batch)
    except (TypeError, ValueError):
        return
    assert result.aux_hidden_states.shape[:2] == batch[0].shape


SECTIONS = {"target": "replicas", "data": "max_length", "train": "steps", "eval": "prompts"}


@settings(max_examples=200, deadline=None)
@given(section=st.sampled_from(sorted(SECTIONS)),
       key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12))
def test_unknown_config_keys_name_the_key(section, key):
    real_keys = {f.name for f in dataclasses.fields(type(getattr(JobConfig(), section)))}
    try:
        from_dict(JobConfig, {section: {key: 1}})
    except ConfigError as e:
        assert f"{section}.{key}" in str(e)
        assert key in real_keys or "allowed keys" in str(e)
    else:
        assert key in real_keys, "only a real key may pass"


@settings(max_examples=200, deadline=None)
@given(section=st.sampled_from(sorted(SECTIONS)),
       value=st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                       st.floats(allow_nan=False).filter(lambda f: not f.is_integer())))
def test_wrong_types_name_the_key(section, value):
    key = SECTIONS[section]  # an int-typed key in each section
    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        from_dict(JobConfig, {section: {key: value}})
