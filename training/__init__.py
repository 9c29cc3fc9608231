"""The fine-tuning recipe: ``training/finetune.py`` (the loop, read top to bottom), its config
(``training.config``), data (``training.data``), checkpoints (``training.checkpoint``), flow matching
(``training.flow``), text/video encoding (``training.encoding``, ``training/precompute.py``) and the VAE
task (``training.vae``). The built-in model's factory (build, synthetic world, analyser, evaluation)
lives apart in ``training.builtin``."""
