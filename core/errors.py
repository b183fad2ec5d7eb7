"""Typed errors for users: each says what was wrong, where, and what to do.

The CLI prints `str(error)` as one line and exits non-zero; `--debug` shows the traceback.
Workers raise these too; `Orchestrator.fit` unwraps them from Ray's wrappers so the user
sees the same one line whether the problem was found on the driver or on a worker.
"""


class ArchipelagoError(Exception):
    """Base class for errors caused by the user's input or environment, not by a bug."""

    def __init__(self, what: str, *, where: str = "", fix: str = ""):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self._format())

    def _format(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if self.fix:
            text += f" — {self.fix}"
        return text

    def __reduce__(self):
        # Keyword-only arguments do not survive default pickling; Ray pickles errors raised in workers.
        return _rebuild, (type(self), self.what, self.where, self.fix)


def _rebuild(cls, what, where, fix):
    return cls(what, where=where, fix=fix)


class ConfigError(ArchipelagoError):
    """A job config is missing, malformed, or asks for something impossible."""


class DataError(ArchipelagoError):
    """A dataset is missing, empty, corrupt, or does not match the job."""


class CheckpointError(ArchipelagoError):
    """A checkpoint is missing, incomplete, or belongs to another model or dataset."""


class ClusterError(ArchipelagoError):
    """The Ray cluster cannot be reached or cannot host the job."""


class TopologyError(ArchipelagoError):
    """A topology file, nvidia-smi text or probe result is malformed or contradicts itself."""


class CompileError(ArchipelagoError):
    """torch.compile made a training step that computes something else than the same model run
    eagerly: training on it would be silently wrong."""


class PlacementError(ArchipelagoError):
    """A job cannot be placed on the cluster: which constraint failed and what would make it fit."""


class RepeatedFailureError(ArchipelagoError):
    """The workers failed with the same error at the same step after a restart: a fault in the model, the data
    or the training code, which every further restart would meet again (a lost node does not come back at the
    same step with the same words)."""


class FailureBudgetError(ClusterError):
    """Workers failed (or were preempted) more often than `[elastic] max_failures`
    (`max_preemption_failures`) allows; the message lists each failure, and the run's last
    committed checkpoint is left as it was, ready for `--resume`."""


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
        return _rebuild_nonfinite, (self.nonfinite, self.numel, self.with_residual)


def _rebuild_nonfinite(nonfinite: int, numel: int, with_residual: bool) -> NonFiniteGradientError:
    return NonFiniteGradientError(nonfinite, numel, with_residual=with_residual)
