"""Shared fixtures: tiny targets are built once per machine (cached), backends once per session."""

from __future__ import annotations

import pytest
import torch

from eagle_ray.tiny import tiny_target


@pytest.fixture(scope="session")
def llama_path():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def qwen3_path():
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def hf_llama(llama_path):
    from eagle_ray.hf_target import HFEagle3TargetModel

    return HFEagle3TargetModel.from_pretrained(llama_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_path):
    from eagle_ray.hf_target import HFEagle3TargetModel

    return HFEagle3TargetModel.from_pretrained(qwen3_path, dtype=torch.float32)
