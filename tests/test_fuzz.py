"""Hostile input, generated: every bad micro-batch or config is a clear error of the documented
kind (never a crash, never another exception), and good input still works after it."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_ray.config import ConfigError, JobConfig, from_dict
from eagle_ray.contract.target_batch import validate_micro_batch
from eagle_ray.testing import random_micro_batch

from fuzz_inputs import EXPECTED, Hostile, hostile_micro_batches, mutate

VOCAB, MAX_LENGTH = 1024, 64


def check_refusal(validator, hostile) -> None:
    """Refused iff invalid (the oracle), with the documented error type and a message naming
    what the mutation broke; accepted otherwise."""
    try:
        validator(*hostile.batch, vocab_size=hostile.vocab_size,
                  max_length=hostile.max_length)
    except (TypeError, ValueError) as e:
        assert not hostile.valid, f"a valid batch was refused: {e!r}"
        assert hostile.explains(e), f"{e!r} does not name what {hostile.mutations} broke"
    else:
        assert hostile.valid, f"an invalid batch ({hostile.mutations}) was accepted"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_micro_batches(VOCAB, MAX_LENGTH))
def test_hostile_micro_batches_are_refused_iff_invalid_saying_what_is_wrong(hostile):
    check_refusal(validate_micro_batch, hostile)


CONTROL_CHOICES = {"ids_dtype": torch.float32, "mask_dtype": torch.float32, "empty": (0, 0),
                   "id_too_large": 0, "id_negative": 1, "mask_shape": 1, "mask_value": 2,
                   "empty_row": 0, "absurd_length": 1}


@pytest.mark.parametrize("mutation", sorted(EXPECTED))
def test_the_fuzz_check_fails_a_validator_that_accepts_everything(mutation):
    """The control: with the validator a no-op, every mutation's batch fails the check."""
    batch = random_micro_batch(VOCAB, (5, 3), seed=1)
    choice = CONTROL_CHOICES.get(mutation)  # what the mutation would draw
    hostile = Hostile(mutate(batch, mutation, lambda _: choice, VOCAB, MAX_LENGTH),
                      (mutation,), VOCAB, MAX_LENGTH)
    assert not hostile.valid
    with pytest.raises(AssertionError, match="was accepted"):
        check_refusal(lambda *a, **k: None, hostile)
    check_refusal(validate_micro_batch, hostile)  # the real one passes


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_hf_backend_refuses_invalid_batches_and_serves_valid_ones(hf_llama, data):
    hostile = data.draw(hostile_micro_batches(hf_llama.vocab_size, hf_llama.max_length))
    try:
        result = hf_llama.generate_batch(*hostile.batch)
    except (TypeError, ValueError) as e:
        assert not hostile.valid and hostile.explains(e), (hostile.mutations, e)
        return
    assert hostile.valid, f"served an invalid batch ({hostile.mutations})"
    assert result.aux_hidden_states.shape[:2] == hostile.batch[0].shape


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
