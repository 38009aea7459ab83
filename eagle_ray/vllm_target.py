"""Public path of the vLLM backend (stable): it lives in `eagle_ray.backends.vllm.target`.
Importing it does not import vLLM."""

from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

__all__ = ["VLLMEagle3TargetModel"]
