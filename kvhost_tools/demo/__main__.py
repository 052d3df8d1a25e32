"""``python -m kvhost_tools.demo``: the same as ``kvhost demo``; decode starts prefill this way.

Prefill's agent is closed by the time ``main`` returns; skipping the interpreter's teardown
(a second with torch loaded) lets decode finish sooner.
"""

import os
import sys

from kvhost_tools.demo.cli import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
