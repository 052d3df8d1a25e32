"""The tools beside the kvhost library: the ``kvhost`` command, the hand-off demo and the bench.

Nothing here is imported by ``import kvhost``; these modules use the library as an
engine would.
"""
