"""EAGLE-3 for target architectures whose vLLM model class lacks it, and sampled speculative
decoding on the CPU build, as a vLLM plugin.

vLLM captures a target's aux hidden states (for eagle_ray's supervision, and for serving an
EAGLE-3 draft) only on model classes that implement `SupportsEagle3`. vLLM 0.32's
`MixtralForCausalLM` does not ("Model does not support EAGLE3 interface but
aux_hidden_state_outputs was requested"). `register` -- the `vllm.general_plugins` entry point
this package installs, so every vLLM process of an environment with eagle_ray in it loads it,
including a `vllm serve` of an exported draft -- registers the subclass below in its place, and
does nothing once vLLM's own class supports EAGLE-3. Equal to the HF reference on every slot:
tests/backends/test_vllm_target.py. It also fixes two defects of the CPU build: the
rejection-sampler kernel (`cpu_sampling`), which must be in place before the worker registers
its kernel overrides, and the DFlash model's context-key norm (`cpu_dflash`). Where torchvision
cannot be imported (the CPU build), it first installs the stand-ins that let vLLM's Qwen2-VL-family
modules and processors serve images (`torchvision_shim`): vLLM imports those modules when it
inspects the model, in every process, after loading its plugins.
"""

from __future__ import annotations

MIXTRAL = "MixtralForCausalLM"


def register() -> None:
    """The plugin entry point (`pyproject.toml`: `vllm.general_plugins`)."""
    from eagle_ray.backends.vllm import torchvision_shim

    torchvision_shim.install()  # before anything imports a vision-language model module

    from vllm import ModelRegistry
    from vllm.model_executor.models.mixtral import MixtralForCausalLM

    from eagle_ray.backends.vllm import cpu_dflash, cpu_sampling

    cpu_sampling.install()
    cpu_dflash.install()

    if not getattr(MixtralForCausalLM, "supports_eagle3", False):
        ModelRegistry.register_model(
            MIXTRAL, "eagle_ray.backends.vllm.mixtral:Eagle3MixtralForCausalLM")
