"""The ground floor: what every command of the project shares, with no model in it.

- :mod:`common.errors`: the error boundary of every command (``run_cli``, exit codes, the unexpected-error
  log) and the named errors; checks of text, seeds and devices from outside.
- :mod:`common.outputs`: atomic outputs (``atomic_write`` for files, ``atomic_dir`` for folders), checked
  output folders.
- :mod:`common.video`: writing and reading videos (mp4, gif, frame grids), each write atomic and read back.
- :mod:`common.timing`: stage timers and timing tables.

It imports only the standard library, numpy, torch and PIL; ``pipelines``, ``world``, ``training``, ``app``
and the packages above them import it, and ``mhla`` stays below it (the operator imports nothing of the project).
"""
