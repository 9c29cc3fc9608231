"""How the libraries this package builds on are made to behave as a text-to-video product needs, in one place
(imported by the loaders and the tiny model's builder before they import diffusers' pipelines)."""

from __future__ import annotations


def quiet_image_processors() -> None:
    """Where torchvision is absent, ``transformers.CLIPImageProcessor`` names its PIL class before anything asks
    for it. transformers 5 answers that name with the PIL class anyway there, but with a warning ("requires
    torchvision (not installed); falling back to CLIPImageProcessorPil"), and diffusers' Wan image-to-video
    pipeline module imports the name: every generation printed it, a text-to-video model's too. Setting the name
    is what transformers' fallback itself does (once it has warned); with torchvision installed nothing changes."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return
    import sys

    import transformers

    pil = getattr(transformers, "CLIPImageProcessorPil", None)
    # resolving that name puts a new transformers module object in sys.modules: the name goes on both
    for module in (transformers, sys.modules.get("transformers")):
        if pil is not None and module is not None and "CLIPImageProcessor" not in vars(module):
            vars(module)["CLIPImageProcessor"] = pil
