"""Token datasets: the shard format, `prepare` (text → shards), the deterministic sampler."""
