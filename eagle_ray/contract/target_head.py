"""The target's own final norm + `lm_head`, used to turn `last_hidden` into target logits.

The `last_hidden` encoding ships the pre-norm final hidden state (H values per token instead of V
logits); the trainer decodes it with this head. It holds the target's *own* modules (a Gemma
`1 + w` norm stays a Gemma norm), never a re-written RMSNorm, so decoded logits equal the target's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: a replica serving a non-HF backend need not import it
    from transformers import PretrainedConfig, PreTrainedModel


class TargetHead(nn.Module):
    """`logits = lm_head(norm(hidden))`, with the config's soft-capping / scaling if it has them.

    Example:
        >>> head = TargetHead.from_model(hf_model)                 # doctest: +SKIP
        >>> logits = head(batch.last_hidden)  # [B, S, V]          # doctest: +SKIP
        >>> draft = head(batch.last_hidden, token_ids=ids)  # [B, S, len(ids)]  # doctest: +SKIP
    """

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Linear,
        *,
        final_logit_softcapping: float | None = None,
        logit_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.final_logit_softcapping = final_logit_softcapping
        self.logit_scale = logit_scale

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> TargetHead:
        """Share the modules of a loaded causal LM (no copy)."""
        return cls(model.get_decoder().norm, model.get_output_embeddings(),
                   **head_options(model.config))

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the full vocabulary, or only over `token_ids` (e.g. a draft vocabulary)."""
        normed = self.norm(hidden.to(self.lm_head.weight.dtype))
        if token_ids is None:
            logits = self.lm_head(normed)
        else:
            bias = None if self.lm_head.bias is None else self.lm_head.bias[token_ids]
            logits = nn.functional.linear(normed, self.lm_head.weight[token_ids], bias)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def head_options(config: PretrainedConfig) -> dict[str, float | None]:
    """Logit transforms that some architectures apply outside their modules (Gemma, Cohere)."""
    text_config = config.get_text_config()
    return {
        "final_logit_softcapping": getattr(text_config, "final_logit_softcapping", None),
        "logit_scale": getattr(text_config, "logit_scale", None),
    }
