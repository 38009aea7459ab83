"""vLLM's Mixtral with EAGLE-3's aux hidden states (registered by `eagle_ray.backends.vllm.plugin`).

The decoder loop is vLLM's own (`MixtralModel.forward`) with the aux states taken where vLLM's
Llama and Qwen3-MoE take them: the residual stream entering each capture layer. Imported only
inside vLLM processes, lazily, by the model registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models import mixtral
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
from vllm.model_executor.models.mixtral import MixtralForCausalLM, MixtralModel
from vllm.sequence import IntermediateTensors


class Eagle3MixtralModel(MixtralModel, EagleModelMixin):
    """`MixtralModel` that also returns the residual stream at its aux layers.

    It inherits vLLM's `support_torch_compile` wrapper, which binds `self.forward` when the
    instance is built: built as this class from the start, the compiled graph (and CUDA graphs)
    are of this `forward`, aux states included.
    """

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None \
                else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        aux_hidden_states = self._maybe_add_hidden_state([], self.start_layer, hidden_states,
                                                         residual)
        for index, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer),
                                      start=self.start_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
            self._maybe_add_hidden_state(aux_hidden_states, index + 1, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return (hidden_states, aux_hidden_states) if aux_hidden_states else hidden_states


class Eagle3MixtralForCausalLM(MixtralForCausalLM, SupportsEagle3):
    """vLLM's `MixtralForCausalLM` whose decoder is an `Eagle3MixtralModel` (same modules and
    weights; only `forward` differs).

    The parent's `__init__` builds its decoder by the module-level name `MixtralModel`; while it
    runs, that name points at `Eagle3MixtralModel`, so the decoder is built once, as the class
    vLLM then compiles. (Swapping `__class__` after construction left the compiled graph on the
    stock `forward`, which returns no aux states: tests/backends/test_vllm_target.py runs it
    compiled.)
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        with _decoder_class(Eagle3MixtralModel):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        assert isinstance(self.model, Eagle3MixtralModel)


@contextmanager
def _decoder_class(cls: type[MixtralModel]) -> Iterator[None]:
    """`vllm.model_executor.models.mixtral.MixtralModel` is `cls` inside the block (model
    construction runs on one thread per worker process)."""
    stock = mixtral.MixtralModel
    mixtral.MixtralModel = cls
    try:
        yield
    finally:
        mixtral.MixtralModel = stock
