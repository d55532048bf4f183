"""Benchmark: epx_torch's dispatch + combine against transformers' AllToAllEP.

8 ranks (gloo, CPU), 1024 tokens x 1024 hidden per rank, top-8 of 64 experts, ep 8 (tp 1,
fsdp 8), identity experts, forward + backward, float32 and bfloat16, in the same process
group. Each timed step is one forward and one backward of the whole MoE exchange; the time
of a step is the slowest rank's. The three runs, transformers, epx with its default
transport (shared memory when the ranks share a host) and, for comparison, epx with
transport='group' (the process group's all_to_all_single, as transformers uses), alternate
in one loop of EPX_BENCH_ITERS rounds (default 10, after one warm-up round; the order
rotates from round to round), so that a slower minute of the machine falls on all three.
Prints the median step of each and the ratios transformers / epx as the median of each
round's ratio (paired), which the machine's drift moves less than a ratio of medians.

Sizes can be changed with EPX_BENCH_TOKENS, EPX_BENCH_HIDDEN (for a quick run).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

import epx_torch
from harness import say

TOKENS = int(os.environ.get("EPX_BENCH_TOKENS", "1024"))
HIDDEN = int(os.environ.get("EPX_BENCH_HIDDEN", "1024"))
TOP_K, EXPERTS = 8, 64
ITERS = int(os.environ.get("EPX_BENCH_ITERS", "10"))


class _IdentityExperts(torch.nn.Module):
    """What AllToAllEP calls: forward(tokens, local ids, unit weights) -> tokens."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, tokens, expert_ids, weights):
        return tokens


def _inputs(dtype):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    ids = torch.argsort(torch.rand(TOKENS, EXPERTS, generator=g), dim=1)[:, :TOP_K].contiguous()
    w = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), dim=1)
    grad = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    return x, ids, w, grad


def _step_time(step) -> float:
    """One step's time on the slowest rank (seconds), between two barriers."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _interleaved(steps: list) -> list[list[float]]:
    """ITERS rounds (after one warm-up round), each timing every step once; the order
    rotates from round to round. Returns each step's times, round by round."""
    times: list[list[float]] = [[] for _ in steps]
    for i in range(ITERS + 1):
        for j in range(len(steps)):
            s = (i + j) % len(steps)
            t = _step_time(steps[s])
            if i > 0:
                times[s].append(t)
    return times


def _paired_ratio(num: list[float], den: list[float]) -> float:
    """The median over the rounds of num / den, the two timed in the same round."""
    return statistics.median(a / b for a, b in zip(num, den))


def bench(dtype) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import AllToAllEP

    W = dist.get_world_size()
    x, ids, w, grad = _inputs(dtype)

    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=EXPERTS)
    layer = epx_torch.Layer(mesh, hidden=HIDDEN, top_k=TOP_K, dtype=dtype)  # transport "auto"
    layer_group = epx_torch.Layer(mesh, hidden=HIDDEN, top_k=TOP_K, dtype=dtype, transport="group")

    def step_of(lay):
        def step():
            xi = x.detach().requires_grad_()
            wi = w.detach().requires_grad_()
            rows, offsets, handle = epx_torch.dispatch(xi, ids, wi, lay)
            out = epx_torch.combine(rows, handle)  # identity experts
            out.backward(grad)
        return step

    dm = init_device_mesh("cpu", (W, 1), mesh_dim_names=("ep", "tp"))
    ep_impl = AllToAllEP(_IdentityExperts(EXPERTS // W), dm["ep"], dm["tp"])
    w_tf = w.to(dtype)  # transformers' routers hand the weights in the activations' dtype

    def tf_step():
        xi = x.detach().requires_grad_()
        wi = w_tf.detach().requires_grad_()
        out = ep_impl(xi, ids, wi)
        out.backward(grad)

    # Same results first (identity experts: out = sum_j w_j x).
    xa = x.detach().requires_grad_()
    rows, offsets, handle = epx_torch.dispatch(xa, ids, w, layer)
    a = epx_torch.combine(rows, handle)
    b = ep_impl(x, ids, w_tf)
    err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
    if dtype == torch.float32:
        # float32 (u = 2^-24). w_j > 0, so every term w_j x of a token has the sign of x,
        # sum_j |w_j x| = |out|, and each error below is relative to |out| element by element.
        # epx: each product rounded, then added in float32 in slot order from 0 (that first
        # addition exact), so each term passes through at most k roundings (its product's and
        # the additions from its own on): e_epx <= gamma_k = k u / (1 - k u). transformers: the
        # weights stay float32 (no rounding), each product rounded, torch's sum over the k
        # slots in float32 (k - 1 additions, in whatever order): e_tf <= gamma_k too. So
        # |a - b| <= 2 gamma_k max |out| while max |b| >= (1 - gamma_k) max |out|:
        # 2 gamma_k / (1 - gamma_k), 16 u = 9.54e-7 to first order for k = 8. Measured: 0
        # (torch sums the slots in slot order too: the same operations, the same bits).
        u = 2**-24
        g = TOP_K * u / (1 - TOP_K * u)
        tol = 2 * g / (1 - g)
    else:
        # bfloat16 (u = 2^-8): every term w_j x of a token has the sign of x (w_j > 0), so
        # sum_j |w_j x| = |out| and each error below is relative to |out| element by element.
        # epx: a float32 sum of the k products (gamma_k = k 2^-24 / (1 - k 2^-24)) rounded
        # once: e_epx = (1 + u)(1 + gamma_k) - 1. transformers: the weights rounded to
        # bfloat16, each product rounded to bfloat16, torch's sum over the k slots in float32
        # rounded once: e_tf = (1 + u)^3 (1 + gamma_k) - 1 (about 3 u). So |a - b| <= (e_epx +
        # e_tf) max |out| while max |b| >= (1 - e_tf) max |out|: about 4.06 u = 1.59e-2.
        u, g = 2**-8, TOP_K * 2**-24 / (1 - TOP_K * 2**-24)
        e_epx, e_tf = (1 + u) * (1 + g) - 1, (1 + u) ** 3 * (1 + g) - 1
        tol = (e_epx + e_tf) / (1 - e_tf)
        # epx alone against the exact sum: within e_epx (one rounding), where the same sum
        # accumulated in bfloat16 (each product and partial sum rounded) is not.
        exact = x.double() * w.double().sum(1, keepdim=True)
        acc = (w[:, :1] * x.float()).to(dtype)
        for j in range(1, TOP_K):
            acc = acc + (w[:, j:j + 1] * x.float()).to(dtype)
        mine, theirs = (((t.double() - exact).abs().max() / exact.abs().max()).item() for t in (a, acc))
        if not mine <= e_epx:
            raise AssertionError(f"epx against the exact sum: relative error {mine:.2e} above {e_epx:.2e}")
        if not theirs > e_epx:
            raise AssertionError(f"a bfloat16 accumulation of the same sum is within epx's bound ({theirs:.2e} <= "
                                 f"{e_epx:.2e}): the bound cannot tell it from epx's")
    if not err <= tol:
        raise AssertionError(f"epx and transformers differ: relative error {err:.2e} above {tol:.2e}")

    worst = torch.tensor([err], dtype=torch.float64)  # the largest over the ranks, printed
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    t_tf, t_epx, t_group = _interleaved([tf_step, step_of(layer), step_of(layer_group)])
    return {
        "epx": statistics.median(t_epx),
        "tf": statistics.median(t_tf),
        "group": statistics.median(t_group),
        "ratio": _paired_ratio(t_tf, t_epx),
        "ratio_group": _paired_ratio(t_tf, t_group),
        "shm": layer.shared_memory,
        "err": worst.item(),
        "tol": tol,
    }


def cases(W: int):
    if W != 8:
        return []
    results = {}

    def run(dtype, target):
        b = bench(dtype)
        results[dtype] = b["ratio"]
        say(f"  bench {str(dtype).replace('torch.', '')}: {W} ranks, {TOKENS} tokens x {HIDDEN} hidden per rank, "
            f"top-{TOP_K} of {EXPERTS} experts, ep {W}, identity experts, forward+backward, {ITERS} interleaved "
            f"rounds: epx {b['epx'] * 1e3:.1f} ms ({'shared memory' if b['shm'] else 'process group'}), "
            f"transformers AllToAllEP {b['tf'] * 1e3:.1f} ms, ratio {b['ratio']:.2f}x (paired; target {target}x); "
            f"epx over the process group's all_to_all (transport='group') {b['group'] * 1e3:.1f} ms, "
            f"ratio {b['ratio_group']:.2f}x; outputs of epx and transformers differ by {b['err']:.2e} at most (bound "
            f"{b['tol']:.2e})")

    return [("bench float32: epx vs transformers AllToAllEP (ratio printed)", lambda: run(torch.float32, 5)),
            ("bench bfloat16: epx vs transformers AllToAllEP (ratio printed)", lambda: run(torch.bfloat16, 3))]
