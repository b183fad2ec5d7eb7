"""bf16 weights with fp32 masters: forward and backward on a bf16 copy of the model.

    # model: the fp32 master that the optimizer steps, checkpoints save and evaluation runs
    copy = Bf16ComputeCopy(model, GPT(config.model).to(device, torch.bfloat16))
    copy.pull_weights()               # before the step's first forward: bf16(master) into the copy
    ... forward and backward on copy.model, outside autocast ...
    copy.push_gradients()             # after the last backward: the copy's gradients, as fp32, onto the master

Under autocast the fp32 weights are cast to bf16 at every forward, their bf16 gradients cast back
to fp32, and the residual stream and norms run in fp32. Here weights, activations and gradients are
bf16 throughout, and only the optimizer sees fp32 (master weights and AdamW states stay fp32, so
small updates are not lost to bf16 rounding). On one H200 the engine's compiled step was 3.4 %
faster on GPT-2 124M and 2.5 % on 1.3B, its loss within 0.4 % of autocast's over 20 steps
(benchmarks/RESULTS.md).

The cost: gradients accumulate over micro-batches and are all-reduced in bf16. The copy holds 2
bytes a parameter more, but bf16 activations hold less: peak memory fell 1.2 GiB (124M) and 3.1
GiB (1.3B) there.
"""

from __future__ import annotations

import torch


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
        self.pull_weights()

    @torch.no_grad()
    def pull_weights(self) -> None:
        """The masters, rounded to bf16, into the copy (the optimizer only updates the masters)."""
        torch._foreach_copy_(self.params, self.master_params)

    @torch.no_grad()
    def push_gradients(self) -> None:
        """The copy's gradients, as fp32, become the masters'; the copy's are dropped (under DDP
        they are views into its buckets, which it points them at again in the next backward)."""
        for master, param in zip(self.master_params, self.params):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
