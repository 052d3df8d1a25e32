"""``kvhost demo``: a prefill process hands a batch of requests to a decode process over real NIXL.

    cli.py      the options (``kvhost demo --help``) into a typed ``Config``; the entry point
    config.py   what both processes agree on: the ``Config``, its limits, the memory estimate
    prefill.py  the prefill process: fill, register, prove the secret, say hello, hold
    decode.py   the decode process: start prefill, pull, post-process, and the faults
    verify.py   every token checked bit for bit against ``values``
    values.py   the token values, a seeded hash of their indices, both processes compute
    report.py   the progress bar, the outcome, the report and its JSON

The transfer side (tables, plans, agents, the handshake) is ``kvhost.nixl``, library code
a connector uses the same way.
"""
