"""epsim's simulator: how long a step takes on given hardware. Depends on ``model`` only."""

from .hardware import (
    Efficiency,
    Fabric,
    HardwareProfile,
    load_profile,
    profile_from_dict,
    shipped_profiles,
)

__all__ = ["Efficiency", "Fabric", "HardwareProfile", "load_profile", "profile_from_dict", "shipped_profiles"]
