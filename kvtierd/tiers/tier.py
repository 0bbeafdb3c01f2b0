"""The tiers below the device, as values: a `StrEnum`, so settings, JSON and metric labels see each one's name."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    """Nearest first: a lookup asks them in this order."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"
