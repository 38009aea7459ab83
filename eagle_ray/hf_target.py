"""Public path of the transformers backend (stable): it lives in `eagle_ray.backends.hf`."""

from eagle_ray.backends.hf import HFEagle3TargetModel

__all__ = ["HFEagle3TargetModel"]
