"""The compression kernels as they were before issue #7 (commit 20c8bc3), frozen for one comparison.

benchmarks/kernels.py --previous times this copy beside the current kernels in the same run, so
one GPU session shows old against new. Nothing else imports it: delete this folder once the
new kernels have been measured.
"""

from kernels.previous.compression import compress, decompress_accumulate, decompress_sum, topk_by_magnitude

__all__ = ["compress", "decompress_accumulate", "decompress_sum", "topk_by_magnitude"]
