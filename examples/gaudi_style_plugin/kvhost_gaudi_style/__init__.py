"""A Gaudi-style engine plugged into kvhost: its caches described, its device registered.

``caches`` says how the engine's fused-slot (K, V) caches look to kvhost; ``backend`` is
the device backend kvhost finds through this distribution's entry point. Neither module
imports a device stack.
"""

from kvhost_gaudi_style.backend import GaudiStyleBackend
from kvhost_gaudi_style.caches import AXES, GaudiStyleCaches, block_views

__all__ = ["AXES", "GaudiStyleBackend", "GaudiStyleCaches", "block_views"]
