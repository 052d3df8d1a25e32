"""``python -m kvhost_tools.bench``: the same as ``kvhost bench``."""

from kvhost_tools.bench.cli import main

raise SystemExit(main())
