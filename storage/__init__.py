"""Where KV bytes live: the device pool, the host slab and the LMDB disk store, plus the SQL session store."""
