"""Host-side scheduling: requests, the continuous-batching scheduler, the KV block pool.
Plain Python: nothing here imports JAX."""
