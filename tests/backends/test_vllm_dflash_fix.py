"""DFlash drafts on vLLM 0.32's CPU build: the context-key norm its model computes for every draft
layer at once, and eagle_ray's fix (eagle_ray/backends/vllm/cpu_dflash.py). End to end, with the
kit's three-layer draft: scripts/repro_vllm_dflash_acceptance.py."""

import types

import torch

from eagle_ray.backends.vllm import cpu_dflash

LAYERS, CONTEXT, KV_HEADS, HEAD_DIM, EPS = 3, 7, 2, 16, 1e-6


def context_keys():
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(LAYERS, CONTEXT, KV_HEADS, HEAD_DIM, generator=generator)
    weights = torch.rand(LAYERS, HEAD_DIM, generator=generator) + 0.5
    return keys, weights, types.SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=EPS)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def test_vllms_cpu_norm_uses_layer_0s_weight_and_the_fix_each_layers_own():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    keys, weights, model = context_keys()
    shipped = getattr(DFlashQwen3Model, cpu_dflash.ORIGINAL,
                      DFlashQwen3Model._normalize_context_k)(model, keys)
    fixed = cpu_dflash.normalize_context_k(model, keys)
    for layer in range(LAYERS):
        own = rms_norm(keys[layer], weights[layer])
        assert torch.allclose(fixed[layer], own, atol=1e-5), layer
        # The defect (the control): every layer normed with row 0.
        assert torch.allclose(shipped[layer], rms_norm(keys[layer], weights[0]), atol=1e-5)
        assert torch.allclose(shipped[layer], own, atol=1e-5) == (layer == 0), layer
    assert not cpu_dflash.stacked_weight_honoured()  # what `install` checks before it patches


def test_the_plugin_installs_the_fix_unless_switched_off(monkeypatch):
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    monkeypatch.setattr(DFlashQwen3Model, "_normalize_context_k",
                        DFlashQwen3Model._normalize_context_k)  # restored afterwards
    monkeypatch.setenv(cpu_dflash.SWITCH, "0")
    assert cpu_dflash.install() is False
    monkeypatch.delenv(cpu_dflash.SWITCH)
    assert cpu_dflash.install() is True
    assert DFlashQwen3Model._normalize_context_k is cpu_dflash.normalize_context_k
    keys, weights, model = context_keys()
    normed = DFlashQwen3Model._normalize_context_k(model, keys)
    assert torch.allclose(normed[2], rms_norm(keys[2], weights[2]), atol=1e-5)


def test_the_fix_keeps_bf16_keys_in_bf16():
    keys, weights, model = context_keys()
    model._k_norm_weights = weights.bfloat16()
    fixed = cpu_dflash.normalize_context_k(model, keys.bfloat16())
    assert fixed.dtype == torch.bfloat16
    for layer in range(LAYERS):
        assert torch.allclose(fixed[layer].float(), rms_norm(keys[layer], weights[layer]),
                              rtol=2e-2, atol=2e-2), layer
