"""Errors the compression kernels raise for the caller to act on."""

from __future__ import annotations


class NonFiniteGradientError(ValueError):
    """A bucket held NaN or inf where the kernels select by magnitude.

    Raised instead of returning a result because a NaN compares false against every threshold: it
    would never be sent, and error feedback would carry it in the residual into every later step.
    """

    def __init__(self, nonfinite: int, numel: int, *, with_residual: bool):
        self.nonfinite = nonfinite
        self.numel = numel
        self.with_residual = with_residual
        source = "bucket + residual" if with_residual else "input"
        fix = "find where it comes from (with fp16, let torch.amp.GradScaler skip the step before compressing)"
        if with_residual:
            fix += "; then reset this bucket's residual with residual.zero_(), its contents are unspecified now"
        super().__init__(f"{nonfinite} of {numel} elements of the {source} are NaN or infinite, "
                         f"so nothing may be sent — {fix}")

    def __reduce__(self):
        # Ray pickles errors raised in workers; keyword-only arguments do not survive default pickling.
        return _rebuild, (self.nonfinite, self.numel, self.with_residual)


def _rebuild(nonfinite: int, numel: int, with_residual: bool) -> NonFiniteGradientError:
    return NonFiniteGradientError(nonfinite, numel, with_residual=with_residual)
