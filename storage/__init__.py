"""Where KV bytes live: device/host pools, and (later) LMDB and Redis stores."""
