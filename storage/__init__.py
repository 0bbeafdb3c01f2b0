"""Where KV bytes live: the device pool, the host slab, the LMDB disk store and the Redis store,
plus the SQL session store."""
