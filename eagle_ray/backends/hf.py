"""The co-located transformers target: the numerical reference for every other backend.

It runs the HF model's decoder stack (not its `lm_head`: the head is applied only when an encoding
asks for it) and captures the aux layers with forward pre-hooks, so nothing but the aux states
and the pre-norm last hidden state is kept. A vision-language model (Qwen2.5-VL, Qwen3-VL) runs
through its own multimodal model, which puts the vision tower's features at the image
placeholders and gives the text decoder its M-RoPE positions (docs/contract.md, "Images").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedModel

from eagle_ray.backends.base import (
    RunnerEagle3TargetModel,
    RunnerOutput,
    Sampling,
    TargetRunner,
)
from eagle_ray.contract.aux_layers import resolve_aux_layer_ids
from eagle_ray.contract.checkpoint import auto_model_class, is_vision_language
from eagle_ray.contract.images import ImageInputs, ImageTokens, check_processor_sizes
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.contract.target_batch import Encoding
from eagle_ray.contract.target_head import TargetHead

logger = logging.getLogger(__name__)


class HFTargetRunner(TargetRunner):
    """Runs a transformers causal LM (or vision-language model) and captures the residual
    stream with hooks.

    Aux id `k` is read as the input of decoder layer `k + 1` (the final norm's for the last
    layer): the stream the next layer reads, which is the layer's own output except where a
    model adds to the stream between layers (Qwen3-VL's deepstack features) -- vLLM captures
    it there too. Works for any decoder that exposes `get_decoder().layers` and `.norm` (Llama,
    Mistral, Qwen2, Qwen3, their relatives, and the text decoder of Qwen2.5-VL / Qwen3-VL).
    """

    def __init__(self, model: PreTrainedModel, aux_layer_ids: Sequence[int],
                 image_processor=None) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.aux_layer_ids = list(aux_layer_ids)
        # The multimodal model (vision tower + text decoder) and what turns an image into its
        # input; None for a text-only target.
        self.multimodal = model.model if is_vision_language(model.config) else None
        self.image_processor = image_processor

    # no_grad, not inference_mode: a co-located trainer may feed the results to autograd.
    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            images: ImageInputs | None = None) -> RunnerOutput:
        captured: dict[int | str, torch.Tensor] = {}
        layers = self.decoder.layers

        def keep_input(key: int | str):
            def hook(_module, args, kwargs):
                captured[key] = args[0] if args else kwargs["hidden_states"]
            return hook

        readers = {k: layers[k + 1] if k + 1 < len(layers) else self.decoder.norm
                   for k in self.aux_layer_ids}
        handles = [readers[k].register_forward_pre_hook(keep_input(k), with_kwargs=True)
                   for k in self.aux_layer_ids]
        handles.append(self.decoder.norm.register_forward_pre_hook(keep_input("last_hidden"),
                                                                   with_kwargs=True))
        device = next(self.model.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        positions = None
        try:
            if images is None:
                self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            else:
                positions = self._run_with_images(input_ids, attention_mask, images)
        finally:
            for handle in handles:
                handle.remove()
        aux = torch.cat([captured[k] for k in self.aux_layer_ids], dim=-1)
        return RunnerOutput(aux_hidden_states=aux, last_hidden=captured["last_hidden"],
                            positions=positions)

    def _run_with_images(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         images: ImageInputs) -> torch.Tensor:
        """The multimodal model's forward with explicit M-RoPE positions (its cached rope
        deltas are never consulted); returns their temporal index `[B, S]`, the positions
        vLLM's proposer gives a draft without M-RoPE. The images stay in host memory: the
        processor reads them there, and only its patches go to the model's device."""
        # The images arrive at the size the processor resizes them to: its resize is the
        # identity here, and it normalises and cuts them into patches.
        features = self.image_processor(images=images.arrays(), return_tensors="pt")
        grid = features["image_grid_thw"].to(input_ids.device)
        pixel_values = features["pixel_values"].to(input_ids.device, self.model.dtype)
        token_types = (input_ids == self.model.config.image_token_id).int()
        position_ids, _ = self.multimodal.get_rope_index(
            input_ids, token_types, image_grid_thw=grid, attention_mask=attention_mask)
        self.multimodal(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, pixel_values=pixel_values,
                        image_grid_thw=grid, mm_token_type_ids=token_types, use_cache=False)
        return position_ids[0]


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
                 encoding: Encoding = "last_hidden", draft_vocab: DraftVocab | None = None,
                 image_processor=None) -> None:
        config = model.config.get_text_config()
        num_layers = config.num_hidden_layers
        aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
        self.model = model
        vision = image_tokens(model.config)
        if vision is not None and image_processor is None:
            image_processor = default_image_processor(model.config)
        super().__init__(
            HFTargetRunner(model, aux_layer_ids, image_processor),
            num_hidden_layers=num_layers,
            vocab_size=config.vocab_size,
            aux_layer_ids=aux_layer_ids,
            embedding=model.get_input_embeddings(),
            head=TargetHead.from_model(model),
            encoding=encoding,
            draft_vocab=draft_vocab,
            max_length=getattr(config, "max_position_embeddings", None),
            vision=vision,
        )

    def validate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor, images: ImageInputs | None = None) -> None:
        """The base checks, and images at the size this target's processor takes them."""
        super().validate(input_ids, attention_mask, loss_mask, images)
        if self.vision is not None:
            check_processor_sizes(images, self.runner.image_processor)

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
        """Load a causal LM with `AutoModelForCausalLM.from_pretrained` (a vision-language
        checkpoint with `AutoModelForImageTextToText`) and wrap it.

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
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        model = auto_model_class(config).from_pretrained(
            model_path, dtype=dtype or "auto", trust_remote_code=trust_remote_code, **model_kwargs
        )
        if device is not None:
            model = model.to(device)
        image_processor = None
        if is_vision_language(config):
            from transformers import AutoImageProcessor

            image_processor = AutoImageProcessor.from_pretrained(
                model_path, trust_remote_code=trust_remote_code)
        return cls(model.eval(), aux_layer_ids, encoding=encoding, draft_vocab=draft_vocab,
                   image_processor=image_processor)


def image_tokens(config) -> ImageTokens | None:
    """How a vision-language checkpoint expands an image into placeholder tokens; None for a
    text-only one."""
    if not is_vision_language(config):
        return None
    vision = config.vision_config
    return ImageTokens(config.image_token_id, vision.patch_size, vision.spatial_merge_size)


def default_image_processor(config):
    """Qwen2-VL's PIL image processor sized by the vision config (its default normalisation),
    for a model built without its checkpoint's processor; it resizes nothing a pipeline already
    resized to a multiple of patch x merge."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vision = config.vision_config
    side = vision.patch_size * vision.spatial_merge_size
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size,
                                    merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size,
                                    min_pixels=side * side, max_pixels=2**40)
