"""The built-in model's world: the synthetic clips it is trained on and the analyser that reads a video back.

- ``synthetic``: the renderer, the captions and the vocabulary (``python -m world.synthetic``);
- ``analyse``: reads a clip back into attributes (count, colour, shape, motion) and judges it against
  its caption (``python -m world.analyse VIDEO.mp4 --caption "..."``).

Beside numpy and torch it uses only ``common`` (mp4 read and write, atomic outputs, the error boundary): nothing
here imports the Wan pipelines, the recipe,
the factory or the app. Used by the recipe as a
data source (``data.source: synthetic``), by ``run_app.py`` (the app's verdict) and by ``factory``.
"""
