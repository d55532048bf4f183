"""The device layers against the host layer: Layer(device="cuda") on GPUs (NCCL), or
Layer(device="emulated") (the same device path with CPU tensors over gloo) where no GPU is.

Every case runs the host layer (device="cpu", over the job's gloo group) and the device
layer on the same inputs and experts and asks for the same bits: expert-major rows, offsets,
output, input, routing-weight and expert gradients (after the expert hook), on both paths
and in float32, bfloat16, float16 and float64. Under `run.py --device cuda` the job's group is
"cpu:gloo,cuda:nccl", every rank uses GPU `local_rank % device_count`, and NCCL needs one
GPU per rank (world size <= GPUs); run.py says SKIP, never PASS, where that does not hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import epx_torch
from harness import check_close, check_equal
from test_ops import E_DEFAULT, H, TOL, batch_data, expert_params, grouped_experts, reference


def against_host_case(device: str, tp=1, ep=None, dtype=torch.float32, path="all_to_all", N=24, k=3, E=E_DEFAULT,
                      padding=(1, 1), train=True):
    W = dist.get_world_size()
    ep = ep if ep is not None else W
    mesh = epx_torch.Mesh(tp=tp, fsdp=W // tp, ep=ep, experts=E)
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    got = []
    for dev in ("cpu", device):
        on = where if dev == device else torch.device("cpu")
        layer = epx_torch.Layer(mesh, hidden=H, top_k=k, dtype=dtype, padding=padding, path=path, device=dev,
                                transport="group" if dev == "cpu" else "auto")
        A, B = expert_params(E, dtype)
        L, first = layer.local_experts, layer.first_expert
        A_loc = A[first:first + L].to(on).requires_grad_()
        B_loc = B[first:first + L].to(on).requires_grad_()
        x, ids, w, G = (t.to(on) for t in batch_data(layer.batch, N, k, E, dtype))
        x.requires_grad_(train)
        w.requires_grad_(train)
        with torch.set_grad_enabled(train):
            rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
            out = epx_torch.combine(grouped_experts(rows, offsets, A_loc, B_loc), handle)
        res = [rows.detach().cpu(), offsets.cpu(), out.detach().cpu()]
        if train:
            out.backward(G)
            layer.reduce_expert_gradients(A_loc.grad)
            layer.reduce_expert_gradients(B_loc.grad)
            res += [x.grad.cpu(), w.grad.cpu(), A_loc.grad.cpu(), B_loc.grad.cpu()]
        got.append(res)
        if dev == device:  # the device layer's output against float64 as well
            ref_out = reference(*(t.detach().cpu() for t in (x, ids, w, G)), A, B)[0]
            check_close(f"{device} output against float64", res[2], ref_out, TOL[dtype])
    names = ["expert rows", "offsets", "output", "input gradient", "routing-weight gradient", "expert gradient A",
             "expert gradient B"]
    for name, a, b in zip(names, got[0], got[1]):
        check_equal(f"{name} ({device} against the host layer)", b, a)


def cases(W: int, device: str):
    out = []
    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    add = lambda name, fn: out.append((f"{device} = host: {name}", fn))  # noqa: E731
    for dt in (f32, bf16, f16, f64):
        add(f"all_to_all ep{W} {dt}", lambda dt=dt: against_host_case(device, dtype=dt))
    add("all_to_all inference", lambda: against_host_case(device, train=False))
    add("padding 2 rows, align 4", lambda: against_host_case(device, padding=(2, 4)))
    add("all_reduce (masked) ep == tp", lambda: against_host_case(device, tp=W, ep=W, path="all_reduce"))
    if W >= 2:
        add("all_to_all tp2", lambda: against_host_case(device, tp=2, dtype=f64))
    return out
