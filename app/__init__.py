"""The Gradio app: the same prompt through softmax ("flash"), linear, MHLA and hybrid MHLA self-attention,
side by side with measured latency; and a live latency-versus-sequence-length benchmark.

- :mod:`app.models`: what is loaded once (shared text encoder and VAE, transformers per variant).
- :mod:`app.compare`: presets, request checks, running the variants (taking turns step by step, streamed,
  repeated), the comparison table and chart, permalinks, the example prompts' stored results.
- :mod:`app.interleave`: turn-taking, paired speedups with 95% intervals, a countdown that never rises.
- :mod:`app.quality`: PSNR and SSIM against flash's video, degenerate videos (blank, frozen, saturated),
  the analyser's verdict as text.
- :mod:`app.bench`: operator and transformer latency against token count, plot, JSON/CSV.
- :mod:`app.ui`: the ``gr.Blocks`` page, a thin layer over the modules above.
"""
