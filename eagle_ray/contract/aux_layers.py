"""Which target layers a draft reads, in one convention, and their translation for vLLM.

Canonical ids are *post-layer*: id `k` is the residual stream after decoder layer `k` (HF
`output_hidden_states[k + 1]`). vLLM's `extract_hidden_states` speaks *pre-layer* ids; the
translation lives here once, so capture and export can never disagree (docs/contract.md,
"Aux layer ids"). The backends capture any number N >= 1 of layers (a DFlash draft conditions
on several); an EAGLE-3 draft reads exactly three (`validate_eagle3_aux_layer_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

from eagle_ray.contract.target_batch import NUM_AUX_LAYERS


class AuxLayerIds(list):
    """Aux layer ids already checked for a target of `num_layers` layers: what
    `validate_aux_layer_ids` returns, so a backend's later steps (vLLM's capture ids, the base
    class) do not check them again. Immutable (a change after the check would pass unchecked):
    every mutating method raises; a plain copy (`list(ids)`) is checked again where it is used.
    A list still, so it compares, serialises and prints as the ids it holds."""

    def __init__(self, ids: Sequence[int], num_layers: int) -> None:
        super().__init__(ids)
        self.num_layers = num_layers

    def __reduce__(self):  # pickling a list subclass would append into it
        return AuxLayerIds, (list(self), self.num_layers)

    def _immutable(self, *args, **kwargs):
        raise TypeError("validated aux layer ids are immutable: build a new list of ids and "
                        "validate it (validate_aux_layer_ids)")

    append = extend = insert = remove = pop = clear = sort = reverse = _immutable
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _immutable


def default_eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers in the post-layer convention: `[1, N//2 - 1, N - 4]`.

    Id `k` is the residual stream *after* decoder layer `k` (HF `output_hidden_states[k + 1]`).
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if not (0 <= ids[0] < ids[1] < ids[2] < num_layers):
        raise ValueError(
            f"a target with {num_layers} decoder layers is too shallow for the default EAGLE-3 aux "
            f"layers [1, N//2-1, N-4] = {ids}; pass aux_layer_ids explicitly: three distinct, "
            f"ascending layer ids in [0, {num_layers})"
        )
    return AuxLayerIds(ids, num_layers)


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check canonical (post-layer) aux ids: one or more distinct ints in `[0, N)`, ascending
    (ids checked before for the same `num_layers` pass through)."""
    if isinstance(ids, AuxLayerIds) and ids.num_layers == num_layers:
        return ids
    return AuxLayerIds(_check_ids(list(ids), num_layers), num_layers)


def validate_eagle3_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """`validate_aux_layer_ids`, and exactly three of them: what an EAGLE-3 draft reads."""
    if len(ids) != NUM_AUX_LAYERS:
        raise ValueError(
            f"EAGLE-3 needs exactly {NUM_AUX_LAYERS} aux layer ids, got {len(ids)}: "
            f"{list(ids)}; pass three (the default for this target is "
            f"{_default_or_none(num_layers)})"
        )
    return validate_aux_layer_ids(ids, num_layers)


def _check_ids(ids: list[int], num_layers: int) -> list[int]:
    if not ids:
        raise ValueError(f"aux layer ids must name at least one layer, got []; the EAGLE-3 "
                         f"default for this target is {_default_or_none(num_layers)}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"aux layer ids must be ints, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux layer ids must be distinct, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} are outside [0, {num_layers}) for a target with {num_layers} "
            f"decoder layers (id k = output of decoder layer k, 0-based; the embedding is not a "
            f"layer)"
        )
    if ids != sorted(ids):
        raise ValueError(
            f"aux layer ids must be ascending (the aux states are concatenated in layer order), "
            f"got {ids}; pass {sorted(ids)}"
        )
    return ids


def resolve_eagle3_aux_layer_ids(ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The given ids validated for EAGLE-3 (three), or its default ones when `ids` is None."""
    if ids is None:
        return default_eagle3_aux_layer_ids(num_layers)
    return validate_eagle3_aux_layer_ids(ids, num_layers)


def resolve_aux_layer_ids(ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """What every backend does before it builds its engine: the given ids (any number)
    validated, or EAGLE-3's default ones when `ids` is None."""
    if ids is None:
        return default_eagle3_aux_layer_ids(num_layers)
    return validate_aux_layer_ids(ids, num_layers)


def _default_or_none(num_layers: int) -> list[int] | None:
    try:
        return default_eagle3_aux_layer_ids(num_layers)
    except ValueError:
        return None


def vllm_capture_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Translate canonical ids to vLLM's pre-layer `extract_hidden_states` ids.

    vLLM's id `j` is the stream *entering* layer `j`, so canonical `k` is `k + 1`; the extra id `N`
    is the final hidden state before the final norm (our `last_hidden`). Canonical `N - 1` would be
    captured twice under one id, which vLLM deduplicates, so it is refused.
    """
    ids = validate_aux_layer_ids(aux_layer_ids, num_layers)
    if num_layers - 1 in ids:
        raise ValueError(
            f"aux layer id {num_layers - 1} (the last decoder layer) collides with the final "
            f"hidden state that the vLLM backend captures as id {num_layers}; choose ids below "
            f"{num_layers - 1}"
        )
    return [i + 1 for i in ids] + [num_layers]
