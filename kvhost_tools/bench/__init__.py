"""``kvhost bench``: memcpy (the roofline), the per-request baseline and kvhost, side by side.

For every workload point the methods run in one process on the same bytes, interleaved
in a random order per round, each call starting with the bytes the methods touch out of
every cache (``--cache data``, see ``machine.Device``: small batches would otherwise be
served from the last-level cache for one method and not another). Results are medians
over rounds, leaving out calls that waited for a core another process held (see
``timing.disturbed``; where some method has too few calls left, every method counts every
round, and the point says so).

- ``memcpy``: one plain copy of the same number of bytes between two buffers, on the
  same device(s), by torch's ``copy_`` on its threads, and (``memcpy-1t``, host to host)
  by the C library's ``memcpy`` on one thread: the roofline is the faster of the two at
  each point. An in-place rearrangement needs one read and one write of every byte, the
  traffic of a copy. A plain copy also fetches each destination line before writing it,
  which an in-place rewrite need not (nor a copy with streaming stores, as kvhost's large
  ones are), so kvhost can pass 1.0.
- ``baseline``: ``baseline.py``, the engines' per-request path, with torch's threads;
  ``baseline-1t`` the same on one thread (its many small ops can be faster so). Speedups
  are over the faster of the two at each point.
- ``kvhost``: a ``kvhost.KVHost`` registered once, as a connector holds it;
  ``kvhost-fn``: the module-level calls (``kvhost.receive``, ``kvhost.copy_blocks``).

Named scenarios carry targets and report PASS or FAIL; sweeps vary blocks per request,
block-size ratio, layout pair, dtype and copy direction. Writes a JSON file and a PNG plot
(fraction of roofline against batch size).

The modules, in the order a run uses them:

- ``workloads``: geometries, points, the scenario table and its targets, presets;
- ``machine``: cache sizes, the machine's description, eviction of touched bytes;
- ``footprint``: what a run allocates, estimated before it starts (too much is refused);
- ``baseline``: the per-request path the bench compares against;
- ``methods``: the methods at one point, on caches allocated once per geometry;
- ``verify``: the baseline and kvhost leave the same bytes;
- ``timing``: interleaved rounds, disturbed calls, one point's figures;
- ``targets``: PASS or FAIL per scenario;
- ``output``: tables, the JSON file, the plot;
- ``xla_scaling``: the TPU backend's scaling check, where present;
- ``cli``: the options and the run.

Nothing here is imported by ``import kvhost``.
"""
