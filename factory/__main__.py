"""``python -m factory <stage>``: the built-in model's build (see ``factory.build``)."""

from factory.build import main

raise SystemExit(main())
