import pytest

from eagle_ray.backends.base import (
    default_eagle3_aux_layer_ids,
    validate_eagle3_aux_layer_ids,
    vllm_capture_layer_ids,
)


@pytest.mark.parametrize(("num_layers", "expected"), [(8, [1, 3, 4]), (16, [1, 7, 12]),
                                                      (32, [1, 15, 28])])
def test_default_ids_are_low_middle_high(num_layers, expected):
    assert default_eagle3_aux_layer_ids(num_layers) == expected
    assert validate_eagle3_aux_layer_ids(expected, num_layers) == expected


@pytest.mark.parametrize("num_layers", [2, 4, 6])
def test_too_shallow_target_asks_for_explicit_ids(num_layers):
    with pytest.raises(ValueError, match="too shallow.*pass aux_layer_ids explicitly"):
        default_eagle3_aux_layer_ids(num_layers)


def test_duplicate_ids_are_rejected():
    with pytest.raises(ValueError, match="distinct"):
        validate_eagle3_aux_layer_ids([1, 3, 3], 8)


def test_out_of_range_ids_are_rejected():
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        validate_eagle3_aux_layer_ids([1, 3, 8], 8)
    with pytest.raises(ValueError, match="outside"):
        validate_eagle3_aux_layer_ids([-1, 3, 4], 8)


def test_unsorted_ids_are_rejected_with_the_sorted_suggestion():
    with pytest.raises(ValueError, match=r"ascending.*pass \[1, 3, 4\]"):
        validate_eagle3_aux_layer_ids([4, 1, 3], 8)


def test_wrong_count_and_types_are_rejected():
    with pytest.raises(ValueError, match="exactly 3"):
        validate_eagle3_aux_layer_ids([1, 3], 8)
    with pytest.raises(TypeError, match="ints"):
        validate_eagle3_aux_layer_ids([1.0, 3, 4], 8)


def test_vllm_ids_are_pre_layer_plus_final_state():
    assert vllm_capture_layer_ids([1, 15, 28], 32) == [2, 16, 29, 32]


def test_vllm_rejects_the_last_layer_which_collides_with_the_final_state():
    with pytest.raises(ValueError, match="collides"):
        vllm_capture_layer_ids([1, 3, 7], 8)


def test_ids_are_checked_once_per_target_and_again_for_another(monkeypatch):
    """Validate once per hop: checked ids pass through the backend's later steps (vLLM's
    capture ids, the base class) unchecked; the same ids for another target are checked again."""
    from eagle_ray.contract import aux_layers

    checked = validate_eagle3_aux_layer_ids([1, 3, 4], 8)
    assert checked == [1, 3, 4] and validate_eagle3_aux_layer_ids(checked, 8) is checked
    assert vllm_capture_layer_ids(checked, 8) == [2, 4, 5, 8]
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):  # control: another target
        validate_eagle3_aux_layer_ids(checked, 4)
    calls = []
    real = aux_layers._check_ids
    monkeypatch.setattr(aux_layers, "_check_ids", lambda ids, n: calls.append(n) or real(ids, n))
    vllm_capture_layer_ids(aux_layers.resolve_eagle3_aux_layer_ids([1, 3, 4], 8), 8)
    assert calls == [8], "one check for resolving, none for the capture ids"


def test_a_micro_batch_checked_by_the_caller_is_not_checked_again(monkeypatch):
    from eagle_ray.backends import base as target_runner
    from eagle_ray.config.pool import PoolConfig
    from eagle_ray.testing import fixed_latency_target, random_micro_batch

    backend = fixed_latency_target(PoolConfig(backend="eagle_ray.testing:fixed_latency_target"))
    calls = []
    real = target_runner.validate_micro_batch
    monkeypatch.setattr(target_runner, "validate_micro_batch",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = random_micro_batch(backend.vocab_size, (8, 5))
    backend.generate_batch(*batch, checked=True)
    assert calls == []
    backend.generate_batch(*batch)  # control: unchecked input is checked
    assert calls == [1]


def test_validated_ids_cannot_change_after_the_check_and_survive_pickling():
    import copy
    import pickle

    from eagle_ray.contract.aux_layers import AuxLayerIds, validate_aux_layer_ids

    ids = validate_aux_layer_ids([1, 3, 5], 8)
    for mutate in (lambda: ids.append(9), lambda: ids.__setitem__(0, 9), lambda: ids.sort(),
                   lambda: ids.extend([9]), lambda: ids.pop()):
        with pytest.raises(TypeError, match="immutable"):
            mutate()
    assert ids == [1, 3, 5]
    for back in (pickle.loads(pickle.dumps(ids)), copy.deepcopy(ids)):
        assert isinstance(back, AuxLayerIds) and back == [1, 3, 5] and back.num_layers == 8
    assert validate_aux_layer_ids(ids, 8) is ids  # checked once
    copied = list(ids)  # a plain copy may change, and is checked again
    copied[0] = 9
    with pytest.raises(ValueError, match="outside"):
        validate_aux_layer_ids(copied, 8)
