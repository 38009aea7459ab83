"""eagle_ray: a Ray-actor pool of EAGLE-3 target backends that feeds draft training.

Importing the package imports neither Ray nor vLLM; each backend imports its engine where it
builds it.
"""

__version__ = "0.1.0"
