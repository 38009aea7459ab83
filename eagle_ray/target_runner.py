"""Public path of the engine seam and the contract's names (stable): they live in
`eagle_ray.backends.base`."""

from eagle_ray.backends.base import *  # noqa: F403
from eagle_ray.backends.base import __all__  # noqa: F401
