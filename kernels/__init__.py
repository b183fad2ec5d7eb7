"""Triton kernels for the hot paths, each with a plain-torch reference twin used on CPU and in tests.

Gradient compression for comm hooks (see kernels.compression for the guarantees):
compress() selects the largest magnitudes of bucket + residual and quantises them to int8,
decompress_accumulate() adds a payload into a dense fp32 bucket, decompress_sum() averages a
whole all-gather of payloads into one in a single pass, topk_by_magnitude() is the
selection alone; kernels.wire codes a payload's places Elias–Fano for the wire (1.05 bytes an
entry at k = 1 %, against 2 as offsets). The fused loss (kernels.loss.linear_cross_entropy) makes the output
projection's cross-entropy and its gradient over the logits in one kernel. kernels.adamw steps
AdamW on fp32 master weights straight from bf16 gradients and writes the bf16 weights in the same
pass (bf16 weights, workers/compute_copy.py). Importing this package needs neither triton nor CUDA.
"""

from core.errors import NonFiniteGradientError
from kernels.compression import DEFAULT_BLOCK, compress, decompress_accumulate, decompress_sum, topk_by_magnitude
from kernels.payload import CompressedBucket, PayloadLayout

__all__ = [
    "DEFAULT_BLOCK",
    "CompressedBucket",
    "NonFiniteGradientError",
    "PayloadLayout",
    "compress",
    "decompress_accumulate",
    "decompress_sum",
    "topk_by_magnitude",
]
