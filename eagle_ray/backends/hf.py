"""The co-located transformers target: the numerical reference for every other backend.

It runs the HF model's decoder stack (not its `lm_head`: the head is applied only when an encoding
asks for it) and captures the aux layers with forward hooks, so nothing but the aux states
and the pre-norm last hidden state is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from eagle_ray.backends.base import (
    RunnerEagle3TargetModel,
    RunnerOutput,
    Sampling,
    TargetRunner,
)
from eagle_ray.contract.aux_layers import resolve_aux_layer_ids
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.contract.target_batch import Encoding
from eagle_ray.contract.target_head import TargetHead

logger = logging.getLogger(__name__)


class HFTargetRunner(TargetRunner):
    """Runs a transformers causal LM and captures decoder-layer outputs with hooks.

    Works for any decoder that exposes `get_decoder().layers` and `.norm` (Llama, Mistral, Qwen2,
    Qwen3 and their relatives).
    """

    def __init__(self, model: PreTrainedModel, aux_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.aux_layer_ids = list(aux_layer_ids)

    # no_grad, not inference_mode: a co-located trainer may feed the results to autograd.
    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        captured: dict[int | str, torch.Tensor] = {}
        layers = self.decoder.layers

        def keep_output(layer_id: int):
            def hook(_module, _args, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output
            return hook

        def keep_norm_input(_module, args):
            captured["last_hidden"] = args[0]

        handles = [layers[k].register_forward_hook(keep_output(k)) for k in self.aux_layer_ids]
        handles.append(self.decoder.norm.register_forward_pre_hook(keep_norm_input))
        device = next(self.model.parameters()).device
        try:
            self.decoder(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        aux = torch.cat([captured[k] for k in self.aux_layer_ids], dim=-1)
        return RunnerOutput(aux_hidden_states=aux, last_hidden=captured["last_hidden"])


    @torch.no_grad()
    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """One prompt at a time over the KV cache: greedy at temperature 0, else sampled with
        a generator seeded per prompt (top-p applied)."""
        device = next(self.model.parameters()).device
        generated = []
        for index, prompt in enumerate(prompts):
            generator = torch.Generator(device=device).manual_seed((sampling.seed or 0) + index)
            out = self.model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
            tokens: list[int] = []
            while len(tokens) < sampling.max_new_tokens:
                token = _next_token(out.logits[0, -1].float(), sampling, generator)
                tokens.append(token)
                if token in sampling.stop_token_ids:
                    break
                out = self.model(input_ids=torch.tensor([[token]], device=device),
                                 past_key_values=out.past_key_values, use_cache=True)
            generated.append(tokens)
        return generated


def _next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(0) - ordered < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class HFEagle3TargetModel(RunnerEagle3TargetModel):
    """EAGLE-3 target backend on a transformers model in this process.

    Example:
        >>> target = HFEagle3TargetModel.from_pretrained(path, dtype="float32")  # doctest: +SKIP
        >>> batch = target.generate_batch(ids, attention_mask, loss_mask)         # doctest: +SKIP
    """

    def __init__(self, model: PreTrainedModel, aux_layer_ids: Sequence[int] | None = None,
                 encoding: Encoding = "last_hidden", draft_vocab: DraftVocab | None = None) -> None:
        config = model.config.get_text_config()
        num_layers = config.num_hidden_layers
        aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
        self.model = model
        super().__init__(
            HFTargetRunner(model, aux_layer_ids),
            num_hidden_layers=num_layers,
            vocab_size=config.vocab_size,
            aux_layer_ids=aux_layer_ids,
            embedding=model.get_input_embeddings(),
            head=TargetHead.from_model(model),
            encoding=encoding,
            draft_vocab=draft_vocab,
            max_length=getattr(config, "max_position_embeddings", None),
        )

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
        encoding: Encoding = "last_hidden",
        draft_vocab: DraftVocab | None = None,
        **model_kwargs,
    ) -> HFEagle3TargetModel:
        """Load a causal LM with `AutoModelForCausalLM.from_pretrained` and wrap it.

        Args:
            model_path: a local HF checkpoint folder (or a hub id where a hub is reachable).
            aux_layer_ids: canonical (post-layer) ids, one or more (EAGLE-3 reads three);
                None: `[1, N//2 - 1, N - 4]`.
            dtype: a torch dtype or its name ("bfloat16", "float32"); None or "auto": the
                checkpoint's own.
            device: where the model runs (e.g. "cuda"); None: where transformers loads it.
            trust_remote_code: passed to transformers.
            encoding: the default target encoding of `generate_batch` ("last_hidden",
                "logits", or "target_probs", which needs `draft_vocab`).
            draft_vocab: the draft vocabulary, for the "target_probs" encoding.
            **model_kwargs: passed to `AutoModelForCausalLM.from_pretrained` untouched.
        """
        logger.info("loading HF target %s (dtype=%s)", model_path, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype or "auto", trust_remote_code=trust_remote_code, **model_kwargs
        )
        if device is not None:
            model = model.to(device)
        return cls(model.eval(), aux_layer_ids, encoding=encoding, draft_vocab=draft_vocab)
