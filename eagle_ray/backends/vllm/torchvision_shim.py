"""Stand-ins that let vLLM 0.32 serve Qwen2-VL / Qwen2.5-VL (and Qwen3-VL) image prompts where
torchvision cannot be imported: the CPU build of vLLM runs on a CPU torch, and PyPI's torchvision
wheels are built against CUDA torch and break it, so a CPU install goes without torchvision.

Images only. Two things stand in the way, and `install` replaces both, only where
`import torchvision` fails (with torchvision present it does nothing):

1. vLLM's `qwen2_vl` / `qwen2_5_vl` / `qwen3_vl` model modules import `smart_resize` and
   `Qwen2VLImageProcessor` from `transformers.models.qwen2_vl.image_processing_qwen2_vl`, whose
   first lines import torchvision. A stand-in module of that name exports the PIL processor
   (`image_processing_pil_qwen2_vl`), which computes the same resize and normalisation.
2. The Qwen2-VL-family processors (which vLLM loads to process images) must hold a video
   processor, and without torchvision transformers resolves theirs to placeholder classes
   that raise when built. Qwen2-VL's video module imports torchvision, so a stand-in class
   carries its settings (token counting works) and refuses to process a video; Qwen3-VL's
   module imports without it, so its own class is registered. A real video raises.

The vLLM backend therefore refuses videos (`limit_mm_per_prompt` video 0). `install` runs from
the `vllm.general_plugins` entry point (`plugin.register`), which vLLM calls in every one of its
processes before it inspects or loads a model, and from the runner before it builds an engine;
it only arms an import hook, so the stand-ins are built where a Qwen2-VL-family module is
imported. Checked against transformers on a tiny Qwen2.5-VL: tests/backends/test_vllm_vision.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any

logger = logging.getLogger(__name__)

TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
# Qwen2-VL's video processor defaults (transformers' `Qwen2VLVideoProcessor`).
QWEN2_VL_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "do_sample_frames": False, "fps": 2, "min_frames": 4, "max_frames": 768,
}


def torchvision_importable() -> bool:
    """Whether `import torchvision` works (a broken CUDA wheel beside a CPU torch does not)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or RuntimeError from a wheel built for another torch
        return False
    return True


def install() -> bool:
    """Where torchvision cannot be imported, have the first import of its Qwen2-VL image module
    put the stand-ins in place (an import hook: a text engine never imports the module, so it
    pays nothing, where building them takes a second or two); returns whether it is armed."""
    if not torchvision_importable() and not any(isinstance(f, _StandInFinder)
                                                for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())
    return any(isinstance(f, _StandInFinder) for f in sys.meta_path)


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Answers the import of `TORCHVISION_IMAGE_MODULE` with `_StandInLoader`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TORCHVISION_IMAGE_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, _StandInLoader())


class _StandInLoader(importlib.abc.Loader):
    """Step 1: the torchvision image-processor module, as the PIL one under its name; and,
    since a Qwen2-VL-family model is in use, step 2."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        module.__doc__ = ("eagle_ray stand-in (eagle_ray.backends.vllm.torchvision_shim): "
                          "Qwen2-VL's PIL image processor under the torchvision module's name")
        module.smart_resize = pil.smart_resize
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
        module.__all__ = ["Qwen2VLImageProcessor", "smart_resize"]
        _install_video_processors()
        logger.debug("torchvision missing: Qwen2-VL-family image stand-ins installed (images "
                     "only, videos refused)")


def _install_video_processors() -> None:
    """Step 2: video processors the Qwen2-VL-family processors can be built with."""
    import transformers
    import transformers.models.qwen2_vl as qwen2_vl_package
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    # ProcessorMixin checks `video_processor` against `transformers.VideoProcessorMixin`, which
    # the package leaves out without torchvision (and its fallback lookup then raises).
    transformers.VideoProcessorMixin = VideoProcessorMixin
    qwen2 = qwen2_vl_video_standin()
    transformers.Qwen2VLVideoProcessor = qwen2
    qwen2_vl_package.Qwen2VLVideoProcessor = qwen2
    for config_class, video_class in ((Qwen2VLConfig, qwen2), (Qwen2_5_VLConfig, qwen2),
                                      (Qwen3VLConfig, Qwen3VLVideoProcessor)):
        AutoVideoProcessor.register(config_class, video_processor_classes={"torchvision":
                                                                           video_class},
                                    exist_ok=True)


def qwen2_vl_video_standin() -> type:
    """A `VideoProcessorMixin` named `Qwen2VLVideoProcessor` with Qwen2-VL's video settings:
    it counts a video's tokens and refuses to process one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    from transformers.video_processing_utils import VideoProcessorMixin

    class Qwen2VLVideoProcessor(VideoProcessorMixin):
        """Stand-in for transformers' torchvision Qwen2-VL video processor (images only)."""

        model_input_names = ["pixel_values_videos", "video_grid_thw"]

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**{**QWEN2_VL_VIDEO_DEFAULTS, **kwargs})

        def preprocess(self, videos: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("video input needs torchvision, which cannot be imported "
                                      "here; eagle_ray serves images only without it")

        def get_num_of_video_patches(self, num_frames: int, height: int, width: int,
                                     videos_kwargs: dict | None = None) -> int:
            kwargs = videos_kwargs or {}
            patch = kwargs.get("patch_size") or self.patch_size
            merge = kwargs.get("merge_size") or self.merge_size
            temporal = kwargs.get("temporal_patch_size") or self.temporal_patch_size
            size = self.size or QWEN2_VL_VIDEO_DEFAULTS["size"]
            resized_h, resized_w = smart_resize(height, width, factor=patch * merge,
                                                min_pixels=size["shortest_edge"],
                                                max_pixels=size["longest_edge"])
            return -(-num_frames // temporal) * (resized_h // patch) * (resized_w // patch)

    Qwen2VLVideoProcessor.__module__ = __name__
    Qwen2VLVideoProcessor.__qualname__ = "Qwen2VLVideoProcessor"
    return Qwen2VLVideoProcessor
