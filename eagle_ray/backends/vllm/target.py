"""The vLLM target backend: a real vLLM engine wrapped as an EAGLE-3 target.

Importing this module does not import vLLM; `from_pretrained` does, when it builds the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from eagle_ray.backends.base import RunnerEagle3TargetModel
from eagle_ray.backends.hf import image_tokens
from eagle_ray.backends.vllm.runner import VLLMTargetRunner
from eagle_ray.backends.vllm.vision import checkpoint_image_processor
from eagle_ray.contract.aux_layers import resolve_aux_layer_ids, vllm_capture_layer_ids
from eagle_ray.contract.checkpoint import load_embedding_and_head, resolve_dtype
from eagle_ray.contract.images import ImageInputs, check_processor_sizes
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.contract.target_batch import Encoding

logger = logging.getLogger(__name__)


class VLLMEagle3TargetModel(RunnerEagle3TargetModel):
    """EAGLE-3 target backend on a (tensor-parallel) vLLM engine.

    The engine captures the aux layers and the final pre-norm hidden state through vLLM's
    `extract_hidden_states` method; the embedding and head are read from the checkpoint
    (never a second full model). A vision-language checkpoint (Qwen2.5-VL, Qwen3-VL) takes
    images beside its rows (docs/contract.md, "Images"; `vision`, this package). A self-check
    (on by default) compares vLLM's own greedy token with the head applied to the captured
    final state on every micro-batch.

    Example:
        >>> target = VLLMEagle3TargetModel.from_pretrained(path, dtype="bfloat16", tp_size=2,
        ...                                                vllm_kwargs={"max_model_len": 4096})
        ...                                                # doctest: +SKIP
        >>> batch = target.generate_batch(input_ids, attention_mask, loss_mask)  # doctest: +SKIP
    """

    image_processor: Any = None  # a vision-language checkpoint's: the size images must travel at

    def validate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor, images: ImageInputs | None = None) -> None:
        """The base checks, and images at the size the checkpoint's processor takes them."""
        super().validate(input_ids, attention_mask, loss_mask, images)
        if self.image_processor is not None:  # (else vLLM's expansion is checked per row)
            check_processor_sizes(images, self.image_processor)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype | str | None = None,
        tp_size: int = 1,
        trust_remote_code: bool = False,
        vllm_kwargs: dict[str, Any] | None = None,
        encoding: Encoding = "last_hidden",
        draft_vocab: DraftVocab | None = None,
        self_check: bool = True,
        **runner_options: Any,
    ) -> VLLMEagle3TargetModel:
        """Build the capturing vLLM engine and read the embedding and head from the checkpoint.

        Args:
            model_path: a local HF checkpoint folder with safetensors weights.
            aux_layer_ids: canonical (post-layer) ids, one or more (EAGLE-3 reads three);
                None: `[1, N//2 - 1, N - 4]`.
                The last decoder layer (`N - 1`) is refused (it collides with the final state).
            dtype: a torch dtype or its name; None or "auto": the checkpoint's own.
            tp_size: tensor-parallel ranks of the engine (on CPU each gets its share of cores).
            trust_remote_code: passed to vLLM and transformers.
            vllm_kwargs: passed to `vllm.LLM` untouched, over small-machine defaults
                (`runner.CPU_DEFAULTS` / `GPU_DEFAULTS`). Keys the backend owns
                (`model`, `speculative_config`, `kv_transfer_config`, `skip_tokenizer_init`)
                are refused.
            encoding: the default target encoding of `generate_batch`.
            draft_vocab: the draft vocabulary, for the "target_probs" encoding.
            self_check: compare vLLM's greedy token with the head over the captured final state
                on every micro-batch, and with TP each rank's copy of the first captured aux
                layer with rank 0's (`SelfCheckError` on a mismatch); turn off only to debug.
            **runner_options: where the engine core runs and how captured states come back
                (`multiprocess`, `handoff`, `handoff_dir`, `handoff_ring_bytes`,
                `max_call_tokens`, `object_store_bytes`: `runner.VLLMTargetRunner`).
        """
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        text_config = config.get_text_config()
        torch_dtype = resolve_dtype(dtype, text_config)
        num_layers = text_config.num_hidden_layers
        aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
        capture_ids = vllm_capture_layer_ids(aux_layer_ids, num_layers)
        vision = image_tokens(config)
        image_processor = (None if vision is None else
                           checkpoint_image_processor(model_path, vllm_kwargs, trust_remote_code))
        embedding, head = load_embedding_and_head(model_path, torch_dtype, trust_remote_code)
        runner = VLLMTargetRunner(
            str(model_path), capture_ids, text_config.hidden_size, torch_dtype, tp_size=tp_size,
            trust_remote_code=trust_remote_code, vllm_kwargs=vllm_kwargs,
            max_model_len_hint=getattr(text_config, "max_position_embeddings", 0) or 0,
            check_ranks=self_check, vision=vision, **runner_options,
        )
        if not runner.is_cpu and torch.cuda.is_available():
            # The head (and the self-check, and logits / target_probs decoding) on the engine's
            # first GPU, loaded after the engine has sized its KV cache.
            head = head.to("cuda")
        target = cls(
            runner,
            num_hidden_layers=num_layers,
            vocab_size=text_config.vocab_size,
            aux_layer_ids=aux_layer_ids,
            embedding=embedding,
            head=head,
            encoding=encoding,
            draft_vocab=draft_vocab,
            # vLLM needs room for the one sampled token after the prompt.
            max_length=runner.max_model_len - 1,
            self_check=self_check,
            vision=vision,
        )
        target.image_processor = image_processor
        return target
