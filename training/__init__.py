"""Fine-tuning recipe: data (``training.data``, ``training.synthetic``) and the training loop."""
