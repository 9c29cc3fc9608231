"""``python -m training.builtin <stage>``: the built-in model's build (see ``training.builtin.build``)."""

from training.builtin.build import main

raise SystemExit(main())
