"""Token datasets and checkpoint IO: the shard format, `prepare` and `verify`, readers (kvikio, POSIX,
pyarrow.fs), the prefetching loader, the elastic deterministic sampler, and DCP checkpoints on any storage."""
