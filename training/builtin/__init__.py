"""The built-in model's factory: how ``assets/builtin/`` is made and judged, apart from the recipe.

- ``build``: the staged, resumable build (``python -m training.builtin build``);
- ``synthetic``: the world it is trained on (rendered clips with their captions and attributes);
- ``analyse``: reads a generated clip back into attributes (count, colour, shape, motion);
- ``evaluate``: the miniature Table 5 (``python -m training.builtin.evaluate``);
- ``vae_ceiling``: what the VAE alone keeps of a clip (``python -m training.builtin.vae_ceiling``);
- ``transfer_study``: the conversion-recipe study on the built-in model.

The recipe itself (``training/finetune.py`` and its data, config and checkpoint modules) does not
depend on this package except for the synthetic data source (``data.source: synthetic``).
"""
