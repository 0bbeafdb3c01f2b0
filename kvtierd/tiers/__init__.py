"""The lower KV tiers (host slab, LMDB disk): what moves there, when, and how it comes back.

Policy lives here, bytes in `kvtierd.storage`. See docs/ARCHITECTURE.md, "Tiers".
"""
