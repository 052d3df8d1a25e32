"""``python -m kvhost_tools.demo [prefill|decode] ...``: ``kvhost demo``, or one of its engines.

``kvhost demo`` starts every engine this way. An engine's NIXL agents are closed by the
time its ``main`` returns; skipping the interpreter's teardown (a second with torch
loaded) lets the demo finish sooner.
"""

import os
import sys

from kvhost_tools.demo.netenv import park_workers

park_workers(os.environ)  # before torch loads its OpenMP runtime (netenv says why)
role = sys.argv[1] if len(sys.argv) > 1 else ""
if role == "prefill":
    from kvhost_tools.demo.prefill import main
elif role == "decode":
    from kvhost_tools.demo.decode import main
else:
    from kvhost_tools.demo.cli import main
code = main(sys.argv[2:] if role in ("prefill", "decode") else sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
