"""Page accounting for the KV cache: block pool, page tables, allocation."""
