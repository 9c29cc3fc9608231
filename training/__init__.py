"""Fine-tuning recipe: data (``training.data``, ``training.synthetic``) and the training loop
(``training/finetune.py``); the built-in model's build (``training.builtin``), its VAE stage
(``training.vae``), the video analyser (``training.analyse``) and the evaluation (``training.evaluate``)."""
