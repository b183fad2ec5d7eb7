"""The first step's check of torch.compile against eager PyTorch.

On its first micro-batch the engine also runs the model eagerly, on the same weights and tokens, and
stops the run with a CompileError, before any weight changes, when the compiled step computes
something else. Every worker compares the loss. A worker alone compares the gradients too: near the
initial weights a wrong kernel moves the loss little and the gradients much more (torch 2.11's
final-norm race on the 1.3B model put the loss 2.5e-4 off, under check_tolerance, and the run
diverged; benchmarks/compile_check.py measures both). DDP and FSDP reduce gradients inside backward,
across workers whose tokens differ, so with several workers only the loss is compared.

Eager bf16 is not the truth either: it rounds every intermediate, where Inductor's fused kernels keep
fp32, so a sound compile can sit further from it than the tolerance (a Llama-1B on random tokens at its
initial weights: 3.5-3.7 % on an H200). When a parameter's gradient is too far from eager's under
autocast, the micro-batch runs once more eagerly in full precision, and the compiled gradient is
wrong only if it is further from that than the tolerance and than FULL_PRECISION_SLACK times eager's own
distance from it: a wrong kernel is far from both (the race put tok_emb 3.8e-2 from eager bf16, where
sound compiles were 1.2e-3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from core.errors import CompileError
from workers.activation_checkpointing import activation_checkpointing, set_activation_checkpointing


FULL_PRECISION_SLACK = 2.0
"""How much further than eager bf16 the compiled gradient may be from the full-precision one."""


class CompileCheck:
    """Compares one micro-batch of the compiled step with the same micro-batch run eagerly."""

    def __init__(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module], *, loss_tolerance: float,
                 gradient_tolerance: float, compare_gradients: bool):
        self.model = model
        """The module whose parameters the training step's backward fills."""
        self.blocks = blocks
        """Its blocks, recomputed in the eager pass."""
        self.loss_tolerance = loss_tolerance
        self.gradient_tolerance = gradient_tolerance
        self.compare_gradients = compare_gradients
        self.pending = True
        self.result: dict | None = None
        """Both losses and how far apart they and the gradients were, once checked (for the metrics)."""
        self._eager_gradients: dict[str, torch.Tensor] = {}
        self._full_precision: tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]] | None = None
        self.gradient_differences: dict[str, float] = {}
        """Each parameter's relative gradient difference, once checked."""
        self.full_precision_differences: dict[str, tuple[float, float]] = {}
        """For the parameters too far from eager: (compiled, eager) relative distance from the gradient
        computed in full precision, where that pass ran."""

    def run_eagerly(self, forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                    full_precision_forward: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The micro-batch's eager loss. With gradients compared, also runs `backward` on it and keeps
        the gradients on the host, leaving the parameters without any for the compiled step.
        `full_precision_forward` (the same loss without autocast) is the second opinion's, when the
        step trains under autocast."""
        self.pending = False
        self._full_precision = (full_precision_forward, backward) if full_precision_forward is not None else None
        with torch.compiler.set_stance("force_eager"):
            if not self.compare_gradients:
                with torch.no_grad():
                    return forward().detach()
        loss = self._eager_backward(forward, backward)
        self._eager_gradients = self._take_gradients()
        return loss.detach()

    def _eager_backward(self, forward: Callable[[], torch.Tensor],
                        backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        # Recomputing every block keeps the eager pass below the compiled step's memory.
        with torch.compiler.set_stance("force_eager"), _full_activation_checkpointing(self.blocks):
            loss = forward()
            backward(loss)
        return loss

    def _take_gradients(self) -> dict[str, torch.Tensor]:
        """The parameters' gradients, moved to the host; the parameters are left without any."""
        taken = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                taken[name] = p.grad.to("cpu")
            p.grad = None
        return taken

    def check_loss(self, compiled: torch.Tensor, eager: torch.Tensor) -> None:
        """Records both losses; raises CompileError, on every rank at once, when they are further apart
        than the tolerance on any rank."""
        apart = relative_difference(compiled.detach(), eager).reshape(1)
        if dist.is_initialized():
            dist.all_reduce(apart, op=dist.ReduceOp.MAX)
        self.result = {"compiled_loss": float(compiled.detach()), "eager_loss": float(eager),
                       "relative_difference": float(apart)}
        check_compiled_loss(self.result, self.loss_tolerance)

    def check_gradients(self) -> None:
        """After the compiled backward of the same micro-batch: compares each parameter's gradient
        with its eager one; raises CompileError when any is further apart than the tolerance and,
        where a full-precision pass can be made, further from that pass's too (_is_wrong)."""
        too_far = {}
        for name, p in self.model.named_parameters():
            eager = self._eager_gradients.pop(name, None)
            if eager is None and p.grad is None:
                continue
            compiled = p.grad if p.grad is not None else torch.zeros_like(p)
            eager = eager.to(p.device) if eager is not None else torch.zeros_like(p)
            self.gradient_differences[name] = float(relative_difference(compiled, eager))
            if self.gradient_differences[name] > self.gradient_tolerance:
                too_far[name] = eager.to("cpu")
        if too_far and self._full_precision is not None:
            self._ask_full_precision(too_far)
        wrong = [name for name in too_far if self._is_wrong(name)]
        worst = max(wrong or self.gradient_differences, key=self.gradient_differences.get)
        self.result.update(gradient_difference=self.gradient_differences[worst], gradient_worst=worst,
                           gradient_wrong=bool(wrong))
        if worst in self.full_precision_differences:
            compiled, eager = self.full_precision_differences[worst]
            self.result.update(full_precision_compiled=compiled, full_precision_eager=eager)
        check_compiled_gradients(self.result, self.gradient_tolerance)

    def _ask_full_precision(self, too_far: dict[str, torch.Tensor]) -> None:
        """Runs the micro-batch eagerly without autocast and records how far the compiled and the
        eager gradients of `too_far`'s parameters are from that; the compiled gradients are put back."""
        compiled = self._take_gradients()
        forward, backward = self._full_precision
        try:
            self._eager_backward(forward, backward)
            ran = True
        except torch.OutOfMemoryError:  # no second opinion: the first verdict stands
            self._take_gradients()
            self.result["full_precision"] = "out of memory"
            ran = False
        for name, p in self.model.named_parameters():
            if name in too_far and ran:
                reference = p.grad if p.grad is not None else torch.zeros_like(p)
                mine = compiled[name].to(p.device) if name in compiled else torch.zeros_like(p)
                self.full_precision_differences[name] = (float(relative_difference(mine, reference)), float(
                    relative_difference(too_far[name].to(p.device), reference)))
            p.grad = compiled[name].to(p.device) if name in compiled else None

    def _is_wrong(self, name: str) -> bool:
        """Whether a gradient too far from eager's is wrong: always, unless the full-precision pass
        found it no further from the truth than eager bf16 allows."""
        if name not in self.full_precision_differences:
            return True
        compiled, eager = self.full_precision_differences[name]
        return compiled > max(self.gradient_tolerance, FULL_PRECISION_SLACK * eager)


@contextlib.contextmanager
def _full_activation_checkpointing(blocks: Sequence[torch.nn.Module]):
    modes = [activation_checkpointing(block) for block in blocks]
    set_activation_checkpointing(blocks, "full")
    try:
        yield
    finally:
        for block, mode in zip(blocks, modes):
            set_activation_checkpointing([block], mode)


def relative_difference(compiled: torch.Tensor, eager: torch.Tensor) -> torch.Tensor:
    """‖compiled - eager‖ / ‖eager‖ (L2 norms; for one number, |compiled - eager| / |eager|); infinite
    when only the compiled side holds NaN or infinity, and 0 when the eager side does (then the model
    or data is at fault, not the compiler)."""
    compiled, eager = compiled.float(), eager.float()
    apart = torch.linalg.vector_norm(compiled - eager) / torch.linalg.vector_norm(eager).clamp_min(1e-12)
    apart = torch.nan_to_num(apart, nan=float("inf"), posinf=float("inf"))
    return torch.where(torch.isfinite(eager).all(), apart, torch.zeros_like(apart))


_FIX = ("set [compile] enable = false to train eagerly; if the difference is expected rounding "
        "(a model resumed in low precision), raise {key}")


def check_compiled_loss(check: dict, tolerance: float) -> None:
    """Raises CompileError when the compiled and eager losses of `check` (the largest relative
    difference over the ranks) are further apart than `tolerance`."""
    if check["relative_difference"] > tolerance:
        raise CompileError(
            f"the compiled training step's loss on the first micro-batch is {check['compiled_loss']:.6g}, the same "
            f"model run eagerly gives {check['eager_loss']:.6g} ({check['relative_difference']:.3%} apart on the "
            f"worst rank, more than the {tolerance:g} allowed): torch.compile made a step that computes something "
            "else, and training on it would be silently wrong", where="[compile] check_tolerance",
            fix=_FIX.format(key="check_tolerance"))


def check_compiled_gradients(check: dict, tolerance: float) -> None:
    """Raises CompileError when `check` found a wrong gradient: its worst parameter's is further from
    eager's than `tolerance` (relative L2 norm), and no full-precision pass cleared it."""
    if check["gradient_wrong"]:
        full_precision = (f"; run in full precision, the compiled gradient is {check['full_precision_compiled']:.3%} "
                          f"from it and the eager one {check['full_precision_eager']:.3%}"
                          if "full_precision_compiled" in check else "")
        raise CompileError(
            f"the compiled training step's gradient of {check['gradient_worst']} on the first micro-batch is "
            f"{check['gradient_difference']:.3%} away from the same model's run eagerly (the norm of the difference "
            f"over the eager gradient's; more than the {tolerance:g} allowed{full_precision}), while the losses are "
            f"{check['relative_difference']:.2e} apart: torch.compile made a step that computes something else, "
            "and training on it would be silently wrong", where="[compile] gradient_tolerance",
            fix=_FIX.format(key="gradient_tolerance"))
