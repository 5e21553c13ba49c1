"""Storage tiers, fastest first: gpu, host (memfd slab pool), disk (LMDB), remote (Redis/Valkey)."""
