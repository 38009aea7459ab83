"""Where a target's tokenizer comes from. Serving needs none (token ids in, states out), so a
weights-only checkpoint folder serves as it is; rendering chat data and regenerating answers
need one: the checkpoint's own files, or a folder named by `target.vllm_kwargs.tokenizer` (the
key vLLM itself takes for a tokenizer kept elsewhere)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle_ray.config.loader import ConfigError

# Files of which one holds a tokenizer's vocabulary (fast, SentencePiece, BPE, Mistral's tekken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json",
                   "spiece.model")


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether `path` holds a tokenizer (anything but a local folder is assumed to)."""
    folder = Path(path)
    return not folder.is_dir() or any((folder / name).exists() for name in TOKENIZER_FILES)


def tokenizer_path(model_path: str | Path, vllm_kwargs: Mapping[str, Any] | None = None) -> str:
    """The tokenizer of a target: `vllm_kwargs["tokenizer"]` when set, else the checkpoint's."""
    return str((vllm_kwargs or {}).get("tokenizer") or model_path)


def serves_without_tokenizer(model_path: str | Path,
                             vllm_kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether a vLLM engine for this target starts with `skip_tokenizer_init` (no tokenizer
    files where `tokenizer_path` points)."""
    return not has_tokenizer_files(tokenizer_path(model_path, vllm_kwargs))


def check_tokenizer(model_path: str | Path, vllm_kwargs: Mapping[str, Any] | None,
                    needed_for: str) -> str:
    """The target's tokenizer folder; a clear error, before anything starts, when it has no
    tokenizer files."""
    path = tokenizer_path(model_path, vllm_kwargs)
    if not has_tokenizer_files(path):
        raise ConfigError(
            f"{path!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), and "
            f"{needed_for} needs the target's tokenizer: copy its tokenizer files into the "
            f"folder, or set target.vllm_kwargs.tokenizer to a folder that has them")
    return path


def load_tokenizer(model_path: str | Path, vllm_kwargs: Mapping[str, Any] | None,
                   needed_for: str) -> tuple[str, Any]:
    """(the tokenizer's folder, the tokenizer), after `check_tokenizer`."""
    from transformers import AutoTokenizer

    path = check_tokenizer(model_path, vllm_kwargs, needed_for)
    return path, AutoTokenizer.from_pretrained(path)
