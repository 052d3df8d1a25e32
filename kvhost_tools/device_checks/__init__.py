"""Checks and measurements made on a device (a GPU, a TPU's XLA): what ``ci/gpu-check.sh``
runs, kept out of the backends, which know nothing of requests or of the tools.

- ``gpucheck``: the CUDA/XPU backend's bytes against the torch path's, and its receive and
  staging against the device's memcpy and the per-request baseline;
- ``handoff``: the demo's batch read over NIXL into the device's memory, then received;
- ``xla_scaling``: how the TPU backend's compiled graphs and times grow with the batch.
"""
