import pytest

from eagle_ray.target_runner import (
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
