"""Shared fixtures: tiny targets are built once per machine (cached), backends once per session,
and family-shaped tokenizers and checkpoints (stock chat templates) once per session."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import AutoTokenizer

from eagle_ray.tiny import KIT_TOKENIZER, build_tiny_target, build_tokenizer, tiny_target

from stock_templates import LLAMA_3_1_TOKENIZER, MISTRAL_V3_TOKENIZER, QWEN_3_TOKENIZER

FAMILY_TOKENIZERS = {"llama3.1": LLAMA_3_1_TOKENIZER, "qwen3": QWEN_3_TOKENIZER,
                     "mistral": MISTRAL_V3_TOKENIZER, "kit": KIT_TOKENIZER}
# (architecture, tokenizer, padded vocabulary or None): checkpoints shaped like the targets people
# train drafts for; Qwen3's vocabulary is padded past its tokenizer, as Qwen3-8B's is. The
# mixture-of-experts ones (eagle_ray.tiny.MOE_ARCHITECTURES) too.
FAMILY_CHECKPOINTS = {"qwen3": ("qwen3", "qwen3", 1088),
                      "mistral": ("mistral", "mistral", None),
                      "qwen3_moe": ("qwen3_moe", "qwen3", 1088),
                      "mixtral": ("mixtral", "mistral", None),
                      "gpt_oss": ("gpt_oss", "kit", None),
                      "deepseek_v2": ("deepseek_v2", "kit", None)}


@pytest.fixture(scope="session")
def llama_path():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def qwen3_path():
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def hf_llama(llama_path):
    from eagle_ray.backends.hf import HFEagle3TargetModel

    return HFEagle3TargetModel.from_pretrained(llama_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_path):
    from eagle_ray.backends.hf import HFEagle3TargetModel

    return HFEagle3TargetModel.from_pretrained(qwen3_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def family_tokenizers(tmp_path_factory):
    """Tokenizers with each family's special tokens and stock chat template, as loaded from disk."""
    tokenizers = {}
    for family, spec in FAMILY_TOKENIZERS.items():
        path = tmp_path_factory.mktemp(f"tokenizer-{family}")
        build_tokenizer(spec=spec).save_pretrained(path)
        tokenizers[family] = AutoTokenizer.from_pretrained(path)
    return tokenizers


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """Tiny random checkpoints with each family's architecture, tokenizer and stock template."""
    paths = {}
    for family, (arch, tokenizer, vocab_size) in FAMILY_CHECKPOINTS.items():
        paths[family] = build_tiny_target(tmp_path_factory.mktemp(f"checkpoint-{family}"), arch,
                                          tokenizer_spec=FAMILY_TOKENIZERS[tokenizer],
                                          vocab_size=vocab_size)
    return paths


EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with the session's status once every report is written: the
    interpreter's own teardown of native threads left by vLLM, torch and Ray's core worker can
    segfault after a run is decided (CI saw it once), and turn its result into a crash."""
    if EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])
