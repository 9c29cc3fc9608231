"""The fine-tuning recipe: ``training/finetune.py`` (the loop, read top to bottom), its config
(``training.config``), data (``training.data``), checkpoints (``training.checkpoint``), flow matching
(``training.flow``), text/video encoding (``training.encoding``, ``training/precompute.py``) and the VAE
task (``training.vae``). The synthetic world is a data source
from ``world``; the built-in model's factory (build, evaluation, studies) is ``factory``, above the recipe."""
