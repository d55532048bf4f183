"""A job as users end one: a layer still alive, torch.distributed.destroy_process_group(),
then the interpreter's own exit. Run directly under torchrun (not through run.py, whose
harness ends with os._exit); scripts/run-torch-tests.sh checks that every rank exits with 0
and that no process aborts ("terminate called without an active exception": a process
group destroyed late, at interpreter exit, through a reference epx_torch kept).

The mesh (tp 1, ep = the job) makes sub-groups besides the job's group: one TP group of one
rank per rank. The steps are the benchmark's (bench.py: a barrier, then forward and backward,
then an all_reduce of the step's time), the shape with which the teardown aborted in most
runs before epx_torch kept only the names of the groups it makes."""

from __future__ import annotations

import torch
import torch.distributed as dist

import epx_torch
import harness

rank, W = harness.init()
mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=8 * W)
layer = epx_torch.Layer(mesh, hidden=1024, top_k=8, dtype=torch.float32)
g = torch.Generator().manual_seed(5 + layer.batch)
x = torch.randn(1024, 1024, generator=g)
ids = torch.argsort(torch.rand(1024, 8 * W, generator=g), dim=1)[:, :8].contiguous()
w = torch.softmax(torch.randn(1024, 8, generator=g), dim=1)
for _ in range(5):
    dist.barrier()
    xi, wi = x.detach().requires_grad_(), w.detach().requires_grad_()
    rows, offsets, handle = epx_torch.dispatch(xi, ids, wi, layer)
    out = epx_torch.combine(rows * 2.0, handle)
    out.sum().backward()
    assert xi.grad is not None and wi.grad is not None
    dist.all_reduce(torch.tensor([1.0], dtype=torch.float64), op=dist.ReduceOp.MAX)
if rank == 0:
    print("exit_clean: every rank reached the end", flush=True)
dist.destroy_process_group()  # no barrier first: ranks get here at different times
