"""Device side: the runner (params, KV pool, sampler state), shape buckets, the jitted step,
the sampler and KV-cache sizing."""
