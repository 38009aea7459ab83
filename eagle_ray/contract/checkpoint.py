"""Read just the target's embedding, final norm and `lm_head` from its checkpoint.

A backend whose engine owns the weights (vLLM) still has to hand the trainer the target's input
embedding and head. Loading the whole model a second time would double memory for an 8B target, so
this builds the model skeleton on the meta device (no memory), keeps only those three modules --
the target's own classes -- and fills them from the safetensors files (sharded via the index).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
)

from eagle_ray.contract.target_head import TargetHead, head_options

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def resolve_dtype(dtype: torch.dtype | str | None, config: PretrainedConfig) -> torch.dtype:
    """A concrete torch dtype: given, named ("bfloat16"), or the checkpoint's own ("auto"/None)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            return torch.float32
        if isinstance(dtype, torch.dtype):
            return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'bfloat16', 'float16', 'float32'")
    return resolved


def safetensors_weight_map(model_path: str | Path) -> dict[str, Path]:
    """Tensor name -> file holding it, for single-file and sharded checkpoints."""
    root = Path(model_path)
    index = root / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / SAFETENSORS_SINGLE
    if not single.exists():
        raise FileNotFoundError(
            f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {root}; the vLLM backend reads "
            f"the embedding and head from safetensors checkpoints"
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def load_embedding_and_head(
    model_path: str | Path, dtype: torch.dtype, trust_remote_code: bool = False
) -> tuple[nn.Embedding, TargetHead]:
    """The target's input embedding and `TargetHead`, loaded without the decoder layers."""
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = auto_model_class(config).from_config(config, dtype=dtype,
                                                        trust_remote_code=trust_remote_code)
    embedding = skeleton.get_input_embeddings()
    norm = skeleton.get_decoder().norm
    lm_head = skeleton.get_output_embeddings()
    tied = lm_head.weight is embedding.weight
    prefixes = {id(m): name for name, m in skeleton.named_modules()}
    weight_map = safetensors_weight_map(model_path)
    modules = [embedding, norm] if tied else [embedding, norm, lm_head]
    for module in modules:
        prefix = prefixes[id(module)]
        module.to_empty(device="cpu")
        for name, param in module.named_parameters():
            full_name = _stored_name(f"{prefix}.{name}", weight_map)
            if full_name not in weight_map:
                raise KeyError(f"{full_name} is not in the checkpoint at {model_path}")
            with safe_open(weight_map[full_name], framework="pt") as f:
                tensor = f.get_tensor(full_name)
            param.data = tensor.to(dtype)
            param.requires_grad_(False)
    if tied:
        lm_head.weight = embedding.weight
    logger.info("loaded embedding %s and head (%s norm, tied=%s) from %s",
                list(embedding.weight.shape), type(norm).__name__, tied, model_path)
    return embedding, TargetHead(norm, lm_head, **head_options(config))


def is_vision_language(config: PretrainedConfig) -> bool:
    """A target whose checkpoint holds a vision tower and an image placeholder token (the
    Qwen2-VL family's layout: `vision_config`, `image_token_id`)."""
    return (getattr(config, "vision_config", None) is not None
            and getattr(config, "image_token_id", None) is not None)


def auto_model_class(config: PretrainedConfig):
    """The transformers auto class that builds this target: image-text-to-text for a
    vision-language checkpoint (no causal-LM mapping exists for them), else causal LM."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def _stored_name(name: str, weight_map: dict[str, Path]) -> str:
    """`name` as the checkpoint stores it: vision-language checkpoints published before
    transformers 5 keep the text decoder under `model.` where transformers now names it
    `model.language_model.` (transformers converts it on load; this reader does the same)."""
    legacy = name.replace("model.language_model.", "model.", 1)
    return legacy if name not in weight_map and legacy in weight_map else name
