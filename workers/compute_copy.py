"""bf16 weights with fp32 masters: forward and backward on a bf16 copy of the model.

    # model: the fp32 master that the optimizer steps, checkpoints save and evaluation runs
    copy = Bf16ComputeCopy(model, workload.build().to(device, torch.bfloat16))
    copy.pull_weights()               # before the step's first forward: bf16(master) into the copy
    ... forward and backward on copy.model, outside autocast ...
    copy.push_gradients()             # after the last backward: the copy's gradients, as fp32, onto the master
    ... clip, optimizer.step() ...

or, in place of push_gradients, clip and step, with the optimizer's AdamW (the engine does on GPUs):

    copy.step_masters(optimizer, grad_scale=clamp((copy.gradient_norm() + 1e-6) / max_norm, min=1))

Under autocast the fp32 weights are cast to bf16 at every forward, their bf16 gradients cast back
to fp32, and the residual stream and norms run in fp32. Here weights, activations and gradients are
bf16 throughout, and only the optimizer sees fp32 (master weights and AdamW states stay fp32, so
small updates are not lost to bf16 rounding). On one H200 the engine's compiled step was 3.4 %
faster on GPT-2 124M and 2.5 % on 1.3B, its loss within 0.4 % of autocast's over 20 steps
(benchmarks/RESULTS.md).

The cost: gradients accumulate over micro-batches and are all-reduced in bf16. The copy holds 2
bytes a parameter more, but bf16 activations hold less: peak memory fell 1.2 GiB (124M) and 3.1
GiB (1.3B) there.

step_masters() is push_gradients(), optimizer.step() and the next step's pull_weights() as one
pass over the parameters (kernels.adamw): no fp32 master gradients are made, and the next
pull_weights() has nothing to do unless a master changed since (a restored checkpoint).
"""

from __future__ import annotations

import torch

from kernels.adamw import AdamWFromBf16


class Bf16ComputeCopy:
    def __init__(self, master: torch.nn.Module, replica: torch.nn.Module):
        """replica: another instance of the master's model class in bf16 on the same device (built,
        not deep-copied, so that the memory estimator can make one on fake tensors too); its
        weights are overwritten with the master's."""
        self.model = replica
        self.master_params = list(master.parameters())
        self.params = list(replica.parameters())
        if ([(p.shape, p.dtype) for p in self.params]
                != [(p.shape, torch.bfloat16) for p in self.master_params]):
            raise ValueError("the replica's parameters are not the master's shapes in bf16")
        self._adamw: AdamWFromBf16 | None = None
        # The masters' `_version`s when step_masters last wrote them into the copy. Every in-place
        # torch op on a master advances its version (load_state_dict's and a checkpoint restore's
        # copy_ too); the Triton kernel's writes do not, and versions are read after the step.
        # Writes through `.data` (p.data.copy_, vector_to_parameters) do not either: code that
        # changes masters that way must follow with pull_weights(force=True).
        self._versions_in_copy: list[int] | None = None
        self.pull_weights()

    @torch.no_grad()
    def pull_weights(self, force: bool = False) -> None:
        """The masters, rounded to bf16, into the copy (the optimizer only updates the masters);
        nothing to do, unless forced, if step_masters wrote them and none has changed since."""
        versions = self._versions_in_copy
        if not force and versions is not None and versions == [m._version for m in self.master_params]:
            return
        torch._foreach_copy_(self.params, self.master_params)
        self._versions_in_copy = None

    @torch.no_grad()
    def push_gradients(self) -> None:
        """The copy's gradients, as fp32, become the masters'; the copy's are dropped (under DDP
        they are views into its buckets, which it points them at again in the next backward)."""
        for master, param in zip(self.master_params, self.params):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def gradient_norm(self) -> torch.Tensor:
        """The L2 norm of all the copy's gradients, summed in fp32: what get_total_norm gives over the
        fp32 gradients push_gradients would make (bf16 to fp32 is exact)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.params[0].device)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)

    @torch.no_grad()
    def step_masters(self, optimizer: torch.optim.AdamW, grad_scale: torch.Tensor | None = None) -> None:
        """push_gradients(), optimizer.step() with each gradient divided by grad_scale, and the next
        pull_weights(), with the same numbers, in one pass (kernels.adamw); drops the copy's gradients."""
        if self._adamw is None or self._adamw.optimizer is not optimizer:
            self._adamw = AdamWFromBf16(optimizer, self.master_params, self.params)
        self._adamw.step([p.grad for p in self.params], grad_scale)
        for param in self.params:
            param.grad = None
        self._versions_in_copy = [m._version for m in self.master_params]
