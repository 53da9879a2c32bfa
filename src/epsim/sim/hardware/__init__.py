"""What a device can do, as data: the hardware profiles and what they carry.

    profile.py        ``HardwareProfile`` (peaks, fabric, NICs, launch costs), reading and
                      checking a profile (``load_profile``: a shipped name or a path), the
                      shipped ``profiles/*.json``
    efficiency.py     the profile's ``efficiency`` section: achievable fractions, fixed costs,
                      fitted factors (``Efficiency``)
    kernel_tables.py  one measured kernel table over its features, and its lookup
    kernel_sets.py    the profile's ``kernels`` section: tables grouped into kernel sets (aiter,
                      the NVIDIA stack, ...), the fusions each implies
    kernel_inventory.py  the kernels an engine launches per op, per kernel set (data, sourced)
    a2a.py            how an engine's EP dispatch/combine move tokens (low latency or normal)
    table_guard.py    each kernel-table point's implied efficiency against the device's peaks:
                      above peak refused, below a floor flagged

Uses ``epsim.model`` only.
"""

from .efficiency import Efficiency
from .profile import Fabric, HardwareProfile, load_profile, profile_from_dict, shipped_profiles

__all__ = ["Efficiency", "Fabric", "HardwareProfile", "load_profile", "profile_from_dict",
           "shipped_profiles"]
