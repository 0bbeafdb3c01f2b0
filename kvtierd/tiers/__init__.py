"""The lower KV tiers (host slab, LMDB disk, the fleet's Redis): what moves there, when, and how it comes back.

Policy lives in `tier_manager.py`, each tier's mechanism in its backend (`backend.py`), bytes in
`kvtierd.storage`. See docs/ARCHITECTURE.md, "Tiers".
"""
