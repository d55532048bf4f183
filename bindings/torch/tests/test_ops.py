"""epx_torch's ops against a float64 reference, bitwise against epx's fused C++ layer, and on
bad input. Every case runs on every rank; cases() lists those that fit the job's size.

The reference: each rank's batch (batch b = the mesh's batch of the rank) through the whole
layer in float64 in one process: out[t] = sum_j w[t,j] * f_e(x[t]) with
f_e(x) = tanh(x A_e) B_e, loss = sum(out * G). Outputs, input and routing-weight gradients
are compared per rank; expert gradients, after the expert hook, with the mean over all B
batches of the per-batch gradients (contract section 6).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

import epx_torch
from harness import check_close, check_equal, expect_error, rel_err

H, F, E_DEFAULT = 16, 8, 8
# The 16-bit tolerances against the float64 reference, in unit roundoffs u (bfloat16 2^-8,
# float16 2^-11), of rel_err = max |got - ref| / max |ref| (the max-norm of each tensor):
# epx's one rounding of a float32 sum (at most u of the largest element: one_rounding_case
# checks it alone, tightly) plus the experts' roundings in torch, which enter every compared
# quantity: three on the forward path (x A, tanh, h B: a first-order worst case of 4.4 - 5.7 u
# of max |out| on these inputs, all signs aligned) and up to six on the backward paths. They
# partly cancel; measured at 2, 4 and 8 ranks (tp 1 and 2): bfloat16 output 1.25 u, input
# gradient 1.78 u, routing-weight gradient 1.16 u, expert gradients A 1.76 u, B 1.21 u;
# float16 at most 2.1 u (an expert gradient; output 1.4 u). 4 u is twice the largest. The
# experts' share is as large as what a 16-bit accumulation in epx would add (a bfloat16 sum
# of the slots: output 1.49 u, input gradient 1.78 u, routing-weight gradient 2.86 u), so
# this comparison cannot tell one from the other: one_rounding_case does. A rounding of a
# float16 output to bfloat16's precision gives 6 u (float16's).
# With efsdp > 1 (dp_replicate 1) the expert hook sums the efsdp replicas' 16-bit gradients:
# in float32 (efsdp - 1 additions, each exact or within 2^-24 of its partial sum), times 1/B
# (a power of two: exact), rounded once to the layer's type: one rounding more than with
# efsdp 1 (where the hook's 1/B rounds nothing), at most u of max |ref| (half an ulp at its
# binade, plus a few 2^-24). The replicas' own errors (the experts' share above) add too, but
# so do the gradients they are errors of: relative to max |sum| their share grows by
# sum_i max |g_i| / max |sum_i g_i| (1.2 - 4.3 on the meshes measured) only where their
# errors align, which independent roundings do not. Measured on 8 ranks (efsdp 2, 4 and 8;
# tp 1 and 2) and on 4 (efsdp 2): each replica's gradient before the hook at most 1.79 u,
# after the hook at most 1.69 u in bfloat16 and 2.06 u in float16. So the expert gradients
# with efsdp > 1 are held to 4 u + u = 5 u (the experts' share and the hook's rounding; above
# twice the largest); efsdp_sum_case checks the hook's sum alone against its one rounding.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}


def batch_data(b: int, N: int, k: int, E: int, dtype, routing: str = "random"):
    g = torch.Generator().manual_seed(1000 + b)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    if routing == "random":  # k distinct experts per token
        ids = torch.argsort(torch.rand(N, E, generator=g), dim=1)[:, :k]
    elif routing == "one_expert":  # every token's first slot to expert 0, the rest to the last experts
        ids = torch.stack([torch.tensor([0] + list(range(E - k + 1, E)))] * N) if N else torch.zeros(0, k)
    elif routing == "first_half":  # the experts of the upper EP ranks receive nothing
        ids = torch.argsort(torch.rand(N, E // 2, generator=g), dim=1)[:, :k]
    else:
        raise ValueError(routing)
    ids = ids.to(torch.int64).reshape(N, k)
    w = torch.rand(N, k, generator=g, dtype=torch.float64).float()
    G = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    return x, ids, w, G


def expert_params(E: int, dtype):
    g = torch.Generator().manual_seed(7)
    A = (torch.randn(E, H, F, generator=g, dtype=torch.float64) / math.sqrt(H)).to(dtype)
    B = (torch.randn(E, F, H, generator=g, dtype=torch.float64) / math.sqrt(F)).to(dtype)
    return A, B


def reference(x, ids, w, G, A, B):
    """float64: out, grad_x, grad_w, grad_A [E,...], grad_B of one batch."""
    x = x.double().requires_grad_()
    w = w.double().requires_grad_()
    A = A.double().requires_grad_()
    B = B.double().requires_grad_()
    out = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        h = torch.tanh(torch.einsum("nh,nhf->nf", x, A[e]))
        out = out + w[:, j:j + 1] * torch.einsum("nf,nfh->nh", h, B[e])
    loss = (out * G.double()).sum()
    gx, gw, gA, gB = torch.autograd.grad(loss, (x, w, A, B), allow_unused=True)
    return out.detach(), gx, gw, gA, gB


def grouped_experts(rows: torch.Tensor, offsets: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The experts as a grouped matmul over expert-major rows (padding rows included)."""
    outs = []
    for l in range(offsets.numel() - 1):
        r = rows[int(offsets[l]):int(offsets[l + 1])]
        outs.append(torch.tanh(r @ A[l]) @ B[l])
    return torch.cat(outs) if outs else rows[:0]


def layer_case(tp=1, fsdp=None, ep=None, dp_replicate=1, E=E_DEFAULT, k=3, N=12, dtype=torch.float64,
               path="all_to_all", padding=(1, 1), routing="random", train=True, check_padding=False,
               transport="auto", device="cpu"):
    W = dist.get_world_size()
    rank = dist.get_rank()
    fsdp = fsdp if fsdp is not None else W // (tp * dp_replicate)
    ep = ep if ep is not None else fsdp * tp
    mesh = epx_torch.Mesh(tp=tp, fsdp=fsdp, ep=ep, dp_replicate=dp_replicate, experts=E)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=k, dtype=dtype, padding=padding, path=path, transport=transport,
                            device=device)
    kept = {"hidden": H, "top_k": k, "dtype": dtype, "padding": padding, "path": path, "transport": transport,
            "device": device, "mesh": mesh}
    wrong = [f"layer.{a} is {getattr(layer, a)!r}, not {v!r}" for a, v in kept.items() if getattr(layer, a) != v]
    if wrong:
        raise AssertionError("the layer does not keep its arguments: " + "; ".join(wrong))
    if device == "cpu" and transport == "auto" and not layer.shared_memory:
        raise AssertionError("transport='auto' did not take shared memory with every rank on one host")
    A, B = expert_params(E, dtype)
    L, first = layer.local_experts, layer.first_expert
    A_loc = A[first:first + L].clone().requires_grad_()
    B_loc = B[first:first + L].clone().requires_grad_()
    if train:
        layer.register_expert_hooks([A_loc, B_loc])
    # With efsdp > 1 or dp_replicate > 1 and 16-bit experts, the gradients the expert hook
    # sums (each replica's), as they are when the hook reduces them at the end of backward:
    # efsdp_sum_case (dp_replicate 1), dp_replicate_sum_case.
    efsdp_sum = train and dtype in UNIT and mesh.efsdp * mesh.dp_replicate > 1
    before_hook = {}
    if efsdp_sum:
        for name, p in (("A", A_loc), ("B", B_loc)):
            p.register_post_accumulate_grad_hook(lambda p, n=name: before_hook.__setitem__(n, p.grad.clone()))
    x, ids, w, G = batch_data(layer.batch, N, k, E, dtype, routing)
    x.requires_grad_(train)
    w.requires_grad_(train)
    with torch.set_grad_enabled(train):
        rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
        if check_padding:
            rp, align = padding
            seg = offsets[1:] - offsets[:-1]
            if align > 1 and bool((seg % align != 0).any()):
                raise AssertionError(f"segments {seg.tolist()} not multiples of {align}")
            for l in range(L):  # the padding rows (the last ones of each segment) are zero
                if rp > 0 and not bool((rows[int(offsets[l + 1]) - rp:int(offsets[l + 1])] == 0).all()):
                    raise AssertionError(f"padding rows of local expert {l} are not zero")
        y = grouped_experts(rows, offsets, A_loc, B_loc)
        out = epx_torch.combine(y, handle)
    ref_out, ref_gx, ref_gw, _, _ = reference(x.detach(), ids, w.detach(), G, A, B)
    tol = TOL[dtype]
    check_close("output", out, ref_out, tol)
    if not train:
        return
    out.backward(G)
    if dtype in UNIT and path == "all_to_all":
        one_rounding_case(layer, x.detach(), ids, w.detach(), G, A_loc, B_loc, out.detach(), x.grad, w.grad)
    check_close("input gradient", x.grad, ref_gx, tol)
    # Routing weights and their gradients are float32 whatever the layer's type (epx stores
    # grad_w as float32, docs/semantics.md section 4): float32 rounding at most.
    check_close("routing-weight gradient", w.grad, ref_gw, max(tol, 1.2e-7))
    # Expert gradients after the hook: the mean over all B batches.
    gA = torch.zeros(E, H, F, dtype=torch.float64)
    gB = torch.zeros(E, F, H, dtype=torch.float64)
    for b in range(mesh.batches):
        bx, bids, bw, bG = batch_data(b, N, k, E, dtype, routing)
        _, _, _, a, bb = reference(bx, bids, bw, bG, A, B)
        gA += a
        gB += bb
    gA /= mesh.batches
    gB /= mesh.batches
    # Each of the hook's sums of 16-bit gradients, over efsdp > 1 and over dp_replicate > 1,
    # rounds once more (efsdp_sum_case, dp_replicate_sum_case): u more each than the
    # experts' share.
    tol_e = tol + UNIT[dtype] * ((mesh.efsdp > 1) + (mesh.dp_replicate > 1)) if dtype in UNIT else tol
    check_close("expert gradient A", A_loc.grad, gA[first:first + L], tol_e)
    check_close("expert gradient B", B_loc.grad, gB[first:first + L], tol_e)
    if efsdp_sum:
        check = efsdp_sum_case if mesh.dp_replicate == 1 else dp_replicate_sum_case
        check(layer, before_hook, {"A": A_loc.grad, "B": B_loc.grad})


UNIT = {torch.bfloat16: 2**-8, torch.float16: 2**-11}  # u: half an ulp of 1, relative rounding error <= u


def one_rounding_tol(exact: torch.Tensor, abs_terms: torch.Tensor, n: int, u: float) -> float:
    """The bound of rel_err (max |got - exact| / max |exact|) for got = round(float32 sum of
    n terms) with unit roundoff u: the float32 sum errs by at most gamma_n * sum |terms|
    (gamma_n = n 2^-24 / (1 - n 2^-24)), so no sum exceeds M = max |exact| + d, d = gamma_n
    max sum |terms|, and the one rounding errs by at most half an ulp at M's binade,
    u 2^floor(log2 M). Tight: the largest elements get half an ulp of themselves."""
    d = n * 2**-24 / (1 - n * 2**-24) * abs_terms.max().item()
    m = exact.abs().max().item()
    return (u * 2.0 ** math.floor(math.log2(m + d)) + d) / m


def one_rounding_case(layer, x, ids, w, G, A_loc, B_loc, out, grad_x, grad_w):
    """epx's own arithmetic on the all-to-all path, apart from the experts': the output is
    the float32 sum of the k terms w_j y_j rounded once to the layer's type, the input
    gradient the float32 sum of the k slots' row gradients rounded once, the routing-weight
    gradient <y_j, grad_out> summed in float32 (docs/semantics.md section 4; the masked path
    rounds each rank's partial output too, so it is not checked here). Each is compared with
    the exact (float64) sum of the same terms, the experts' outputs and row gradients as
    torch computed them in this layer's type, so the experts' own roundings drop out and the
    bound is one rounding (one_rounding_tol). The same comparison of the sums accumulated in the
    layer's type (each term and partial sum rounded, in slot order; over the hidden
    dimension for the weight gradient) must fail on some rank: the check can tell a
    float32 accumulation from a 16-bit one on these inputs, which the end-to-end comparison
    with TOL cannot (the experts' roundings are as large as what 16-bit accumulation adds).

    The terms come from epx's own calls, which carry them exactly: with the weights one-hot
    on slot j the output is round(1 * y_j) = y_j; with every weight but slot j's zeroed the
    other slots' row gradients are exactly zero, and the input gradient is slot j's row
    gradient (same rows, same shapes, so the experts give the same bits as in the layer's
    call)."""
    dtype, k, u = x.dtype, ids.shape[1], UNIT[x.dtype]
    A, B = A_loc.detach(), B_loc.detach()
    ys, rgs = [], []
    for j in range(k):
        one = torch.zeros_like(w)
        one[:, j] = 1
        with torch.no_grad():
            rows, offsets, handle = epx_torch.dispatch(x, ids, one, layer)
            ys.append(epx_torch.combine(grouped_experts(rows, offsets, A, B), handle))
        only = torch.zeros_like(w)
        only[:, j] = w[:, j]
        xj = x.clone().requires_grad_()
        rows, offsets, handle = epx_torch.dispatch(xj, ids, only, layer)
        epx_torch.combine(grouped_experts(rows, offsets, A, B), handle).backward(G)
        rgs.append(xj.grad)
    wd, Gd = w.double(), G.double()
    terms = [wd[:, j:j + 1] * ys[j].double() for j in range(k)]
    dots = torch.stack([ys[j].double() * Gd for j in range(k)], 1)  # [N, k, H]
    exact = {"output": sum(terms), "input gradient": sum(r.double() for r in rgs),
             "routing-weight gradient": dots.sum(2)}
    tol = {"output": one_rounding_tol(exact["output"], sum(t.abs() for t in terms), k, u),
           "input gradient": one_rounding_tol(exact["input gradient"], sum(r.double().abs() for r in rgs), k, u),
           # float32 gradients; 16-bit products are exact in float32; the TP reduction adds tp terms
           "routing-weight gradient": one_rounding_tol(exact["routing-weight gradient"], dots.abs().sum(2),
                                                       H + layer.mesh.tp, 2**-24)}
    # The same sums accumulated in the layer's type.
    acc_out = (w[:, :1] * ys[0].float()).to(dtype)
    acc_gx = rgs[0]
    for j in range(1, k):
        acc_out = acc_out + (w[:, j:j + 1] * ys[j].float()).to(dtype)
        acc_gx = acc_gx + rgs[j]
    acc_gw = torch.zeros(w.shape, dtype=dtype)
    for h in range(H):
        acc_gw = acc_gw + torch.stack([ys[j][:, h] for j in range(k)], 1) * G[:, h:h + 1]
    acc = {"output": acc_out, "input gradient": acc_gx, "routing-weight gradient": acc_gw.float()}
    names = list(exact)
    excess = torch.tensor([rel_err(acc[n], exact[n]) / tol[n] for n in names], dtype=torch.float64)
    dist.all_reduce(excess, op=dist.ReduceOp.MAX)
    got = {"output": out, "input gradient": grad_x, "routing-weight gradient": grad_w}
    for n in names:
        check_close(f"{n} against the exact sum of the experts' terms (one rounding)", got[n], exact[n], tol[n])
    for n, e in zip(names, excess.tolist()):
        # The input gradient's 16-bit sum of 3 slots has one rounding more than epx's: with
        # 2 ranks' 24 tokens it stays within the bound in bfloat16 (0.88 of it), with 4 or 8
        # ranks' batches it exceeds it (1.30, 1.38).
        if n == "input gradient" and dist.get_world_size() < 4:
            continue
        if not e > 1:
            raise AssertionError(f"{n}: accumulated in {dtype} it is within the one-rounding bound on every rank "
                                 f"(largest error / bound {e:.2f}): the check cannot tell it from epx's")


def efsdp_sum_case(layer, before, after):
    """The expert hook's sum over efsdp (dp_replicate 1) of 16-bit gradients: each rank's
    expert gradients after the hook (`after`) against the exact (float64) sum, divided by B,
    of the gradients the hook got on the ranks of its efsdp group (`before`, as torch left
    them). epx sums them as its host and emulated-device communicators sum (epx/comm/detail/
    reduce.hpp): in float32 in rank order (efsdp - 1 additions), times 1/B (exact here: B is a
    power of two; else one float32 rounding more), then one rounding to the layer's type; so
    the bound is one rounding of a float32 sum of efsdp terms (one_rounding_tol), whatever
    torch's roundings in the experts. The same sum accumulated in the 16-bit type (each
    partial sum rounded) must exceed that bound on some rank when efsdp >= 3, so the check
    tells the two apart; with efsdp 2 they are the same bits (torch adds two 16-bit values
    in float32 and rounds once, as epx does). A hook that left one replica's gradient out
    would err by that replica's whole share (layer_case's comparison with the reference
    already fails it)."""
    mesh, rank, W = layer.mesh, dist.get_rank(), dist.get_world_size()
    members, B = mesh.group_members("efsdp", rank), mesh.batches
    excess = []
    for n in sorted(before):
        every = [torch.empty_like(before[n]) for _ in range(W)]
        dist.all_gather(every, before[n])
        terms = [every[m] for m in members]  # the group's ranks in its order (the sum's order)
        dtype, u = terms[0].dtype, UNIT[terms[0].dtype]
        exact = sum(t.double() for t in terms) / B
        bound = one_rounding_tol(exact, sum(t.double().abs() for t in terms) / B, len(terms), u)
        check_close(f"expert gradient {n} against the exact sum of the efsdp replicas' gradients (one rounding)",
                    after[n], exact, bound)
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t
        excess.append(rel_err(acc * (1.0 / B), exact) / bound)
    if mesh.efsdp < 3:
        return
    excess = torch.tensor(excess, dtype=torch.float64)
    dist.all_reduce(excess, op=dist.ReduceOp.MAX)
    if not excess.max().item() > 1:
        raise AssertionError(f"the efsdp sum accumulated in {dtype} is within the one-rounding bound on every rank "
                             f"(largest error / bound {excess.max().item():.2f}): the check cannot tell it from epx's")


def dp_replicate_sum_case(layer, before, after):
    """The expert hook's two sums of 16-bit gradients with dp_replicate R > 1 (efsdp E >= 1):
    epx sums the gradients of the rank's efsdp group as efsdp_sum_case says (in float32 in
    rank order, times 1/B, rounded once to the layer's type), then those rounded sums of the
    R replicas over dp_replicate, in float32 in replica order, rounded once more
    (epx/grad/hooks.hpp, epx/comm/detail/reduce.hpp; the emulated device's rank_order_sum
    gives the same bits). Each rank's gradients after the hook (`after`) are compared with
    the exact (float64) sum over the E * R ranks of those groups of the gradients the hook
    got (`before`), divided by B, element by element within two_roundings_bound.

    The same two sums accumulated in the 16-bit type (each partial sum rounded) must exceed
    that bound on some rank when E >= 3 or R >= 3. With E = R = 2 (tp 1 ep 1 on 4 ranks)
    they are epx's bits: each sum is one addition of two 16-bit values, which torch does in
    float32 and rounds once, as epx does, so no check of the result can tell them apart
    there. With E = 4 (8 ranks) the 16-bit accumulation exceeds the bound at 73 to 92 of
    the 1024 elements of each gradient, by up to 4.0 - 9.2 times, and epx's error reaches
    0.991 - 0.99998 of it on 4 and 8 ranks: the bound is attained but for its float32
    terms, since a float32 sum of two 16-bit values is often a tie, half an ulp from both
    16-bit neighbours. In the max-norm (max_k bound_k / max |exact|, 1.27 - 1.61 u here, the
    form of one_rounding_tol) the 16-bit accumulation stays within the bound in bfloat16
    (0.74 and 0.96 of it with E = 4; float16 0.78 and 1.06): its extra roundings are
    mostly those of elements below the largest, hence the comparison element by element.

    A hook that left out the dp_replicate sum would give each replica its own efsdp sum,
    off by the other replicas' share (0.76 - 0.86 of the largest element on these meshes):
    layer_case's comparison with the float64 reference fails it first, and this check
    would too (by 250 - 2000 times the bound)."""
    mesh, rank, W = layer.mesh, dist.get_rank(), dist.get_world_size()
    B = mesh.batches
    # The ranks whose gradients the hook sums, in its order: the efsdp group of each member
    # of this rank's dp_replicate group, the replicas in order.
    groups = [mesh.group_members("efsdp", r) for r in mesh.group_members("dp_replicate", rank)]
    excess = []
    for n in sorted(before):
        every = [torch.empty_like(before[n]) for _ in range(W)]
        dist.all_gather(every, before[n])
        terms = [[every[m] for m in members] for members in groups]
        dtype = before[n].dtype
        exact, bound = two_roundings_bound(terms, B, UNIT[dtype], torch.finfo(dtype).tiny)
        if after[n].shape != exact.shape:
            raise AssertionError(f"expert gradient {n}: shape {tuple(after[n].shape)}, expected {tuple(exact.shape)}")
        e = ((after[n].double() - exact).abs() / bound).max().item()
        if not e <= 1:
            raise AssertionError(f"expert gradient {n} against the exact sum of the efsdp and dp_replicate replicas' "
                                 f"gradients: error / bound {e:.3f} at an element, above 1 (two roundings)")
        acc = None
        for ts in terms:
            part = ts[0]
            for t in ts[1:]:
                part = part + t
            part = part * (1.0 / B)
            acc = part if acc is None else acc + part
        excess.append(((acc.double() - exact).abs() / bound).max().item())
    if mesh.efsdp < 3 and mesh.dp_replicate < 3:
        return
    excess = torch.tensor(excess, dtype=torch.float64)
    dist.all_reduce(excess, op=dist.ReduceOp.MAX)
    if not excess.max().item() > 1:
        raise AssertionError(f"the expert hook's two sums accumulated in {dtype} are within the two-rounding bound "
                             f"on every rank (largest error / bound {excess.max().item():.2f}): the check cannot tell "
                             f"them from epx's")


def two_roundings_bound(terms, B: int, u: float, tiny: float):
    """(exact, bound): the exact result of the expert hook's two sums (dp_replicate_sum_case)
    and, element by element, the most that epx's result can differ from it. terms[j] holds
    the E 16-bit gradients of the efsdp group of replica j (j < R). With X_j = sum_i
    terms[j][i] / B, X = sum_j X_j (both exact in float64), gamma_n = n 2^-24 / (1 - n 2^-24)
    and rho(y) = u max(2^floor(log2 y), tiny) (half an ulp at y's binade, or half the
    spacing of the subnormals below tiny: the most by which rounding a value of magnitude
    <= y to the 16-bit type errs; rho grows with y):
      1. S_j, the float32 efsdp sum times 1/B: |S_j - X_j| <= d_j = gamma_n1 sum_i
         |terms[j][i]| / B, with n1 = E - 1 additions (+ 2 where B is not a power of two:
         1/B and the product are rounded too);
      2. r_j = round(S_j): |r_j - S_j| <= rho(|X_j| + d_j), and so |r_j| <= y_j = |X_j| + d_j
         + rho(|X_j| + d_j);
      3. T, the float32 sum of the R values r_j: |T - sum_j r_j| <= gamma_{R-1} sum_j y_j;
      4. so |T - X| <= a = sum_j (d_j + rho(|X_j| + d_j)) + gamma_{R-1} sum_j y_j, and the
         last rounding errs by at most rho(|X| + a).
    bound = a + rho(|X| + a): one_rounding_tol's two terms (a float32 sum's error and half an
    ulp) for each sum, summed, element by element (R + 1 half-ulps: each replica's rounded
    efsdp sum, then the total)."""
    E, R = len(terms[0]), len(terms)

    def gamma(n):
        return n * 2**-24 / (1 - n * 2**-24)

    def rho(y):
        _, ex = torch.frexp(y)  # y = m 2^ex, m in [0.5, 1): 2^floor(log2 y) = 2^(ex - 1)
        return u * torch.where(y > 0, torch.ldexp(torch.full_like(y, 0.5), ex), 0.0).clamp(min=tiny)

    n1 = E - 1 + (2 if B & (B - 1) else 0)
    X = [sum(t.double() for t in ts) / B for ts in terms]
    d = [gamma(n1) * sum(t.double().abs() for t in ts) / B for ts in terms]
    y = [x.abs() + dj + rho(x.abs() + dj) for x, dj in zip(X, d)]
    a = sum(dj + rho(x.abs() + dj) for x, dj in zip(X, d)) + gamma(R - 1) * sum(y)
    exact = sum(X)
    return exact, a + rho(exact.abs() + a)


def bitwise_case(tp=1, ep=None, dtype=torch.float32, path="all_to_all", N=10, k=3, E=E_DEFAULT, padding=(1, 1),
                 transport="auto", train=True, device="cpu"):
    """The split torch ops give the bits of epx::moe_layer (C++, same communicators) with
    experts y = c_l * x; train=False: the output of an inference call (no autograd), whose
    combine reads the returned rows in place with shared memory. device="emulated": the
    device path on the CPU against epx::moe_layer on the emulated device policy over the
    same device communicators."""
    W = dist.get_world_size()
    fsdp = W // tp
    ep = ep if ep is not None else W
    mesh = epx_torch.Mesh(tp=tp, fsdp=fsdp, ep=ep, experts=E)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=k, dtype=dtype, padding=padding, path=path, transport=transport,
                            device=device)
    L = layer.local_experts
    c = [0.5 + 0.25 * ((layer.first_expert + l) % 7) for l in range(L)]  # exact in bf16
    x, ids, w, G = batch_data(layer.batch, N, k, E, dtype)
    x.requires_grad_(train)
    w.requires_grad_(train)
    with torch.set_grad_enabled(train):
        rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
        scale = torch.tensor(c, dtype=dtype)[handle.local_expert_ids()].unsqueeze(1)
        out = epx_torch.combine(rows * scale, handle)
    if train:
        out.backward(G)
    ref_out, ref_gx, ref_gw = epx_torch._C._fused_reference(layer._impl, x.detach(), ids.to(torch.int32), w.detach(),
                                                            G, c, path == "all_reduce")
    check_equal("output", out.detach(), ref_out)
    if not train:
        return
    check_equal("input gradient", x.grad, ref_gx)
    check_equal("routing-weight gradient", w.grad, ref_gw)


# ---- bad input ------------------------------------------------------------------------

class ScaledBlock(torch.nn.Module):
    """A module that holds a layer (at module level: picklable but for the layer)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.scale = torch.nn.Parameter(torch.full((layer.local_experts,), 2.0))

    def forward(self, x, ids, w):
        rows, offsets, h = epx_torch.dispatch(x, ids, w, self.layer)
        per_row = torch.repeat_interleave(self.scale, offsets.diff())
        return epx_torch.combine(rows * per_row[:, None].to(rows.dtype), h)


def error_cases(W: int):
    rank = dist.get_rank()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float32)
    bad = W - 1  # the rank with the bad input

    def data(N=6):
        x, ids, w, _ = batch_data(rank, N, 2, E_DEFAULT, torch.float32)
        return x, ids, w

    def wrong_dtype():
        x, ids, w = data()
        if rank == bad:
            x = x.double()
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", "x has dtype Double",
                     "must be Float")

    def wrong_ids_dtype():
        x, ids, w = data()
        if rank == bad:
            ids = ids.float()
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", "expert ids has dtype Float",
                     "must be an integer type (int64, int32, int16, int8 or uint8)")

    def wrong_device():
        x, ids, w = data()
        if rank == bad:
            x = torch.empty(x.shape, dtype=x.dtype, device="meta")
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", "on device meta")

    def cuda_tensors():
        # CUDA tensors (fake ones: no GPU is needed to make a tensor that says cuda:0) are
        # refused on every rank, in dispatch (x, ids, weights) and combine (expert output),
        # naming the rank and the device; the gradient reductions refuse them too.
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode()

        def on_cuda(t):
            with fake:
                return torch.empty(t.shape, dtype=t.dtype, device="cuda")

        for which, what in ((0, "x"), (1, "expert ids"), (2, "routing weights")):
            args = list(data())
            if rank == bad:
                args[which] = on_cuda(args[which])
            expect_error(lambda: epx_torch.dispatch(*args, layer), "epx_torch dispatch", f"rank {bad}",
                         f"{what} is on device cuda:0", "but this layer runs on cpu")
        x, ids, w = data()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        y = on_cuda(rows) if rank == bad else rows
        expect_error(lambda: epx_torch.combine(y, h), "epx_torch combine", f"rank {bad}",
                     "expert output is on device cuda:0")
        g = on_cuda(torch.zeros(4))
        expect_error(lambda: layer.reduce_expert_gradients(g), "reduce_expert_gradients", "contiguous tensor on cpu")
        expect_error(lambda: layer.reduce_dense_gradients(g), "reduce_dense_gradients", "contiguous tensor on cpu")

    def wrong_shape():
        x, ids, w = data()
        if rank == bad:
            x = torch.randn(6, H + 1)
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", f"x has shape [6, {H + 1}]")

    def ids_shape():
        x, ids, w = data()
        if rank == bad:
            ids = ids[:, :1]
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", "expert ids has shape [6, 1]")

    def bad_expert_id():
        x, ids, w = data()
        if rank == bad:
            ids[4, 1] = E_DEFAULT + 3
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}",
                     f"expert id ({E_DEFAULT + 3}) of token 4 slot 1 out of range [0, {E_DEFAULT})")

    def nan_weight():
        x, ids, w = data()
        if rank == bad:
            w[2, 0] = float("nan")
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", "token 2 slot 0 is not finite")

    def combine_shape():
        x, ids, w = data()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        y = rows[1:] if rank == bad else rows
        expect_error(lambda: epx_torch.combine(y, h), "epx_torch combine", f"rank {bad}", "expert output has shape")

    def not_a_tensor():
        # None (or another object) for a tensor on one rank: every rank raises, naming it, and
        # the next call pairs with the next call (not with the bad rank's retry).
        for which, what in ((0, "x"), (1, "expert ids"), (2, "routing weights")):
            for wrong, text in ((None, f"{what} is None"), ([1.0], f"{what} is a list, not a tensor")):
                args = list(data())
                if rank == bad:
                    args[which] = wrong
                expect_error(lambda: epx_torch.dispatch(*args, layer), "epx_torch dispatch", f"rank {bad}", text)
        x, ids, w = data()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        expect_error(lambda: epx_torch.combine(None if rank == bad else rows, h), "epx_torch combine",
                     f"rank {bad}", "expert output is None")
        x, ids, w = data()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        check_close("combine after the errors", epx_torch.combine(rows * 2, h), 2 * w.sum(1, keepdim=True) * x, 1e-5)

    def not_a_layer_or_handle():
        # Another object for the layer, the handle or the mesh: a TypeError naming what was
        # passed. A Layer's argument check is collective: a rank whose mesh is not a Mesh
        # raises TypeError, the others EpxError naming it.
        x, ids, w = data()
        for wrong in (mesh, None):
            expect_error(lambda: epx_torch.dispatch(x, ids, w, wrong), "epx_torch dispatch: layer must be an "
                         f"epx_torch.Layer, not {type(wrong).__name__}", error=TypeError)
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        for wrong in ((rows, offsets, h), offsets, None):
            expect_error(lambda: epx_torch.combine(rows, wrong), "epx_torch combine: handle must be the Handle that "
                         "dispatch returned", f"not {type(wrong).__name__}", error=TypeError)
        check_close("combine after the errors", epx_torch.combine(rows * 2, h), 2 * w.sum(1, keepdim=True) * x, 1e-5)
        if rank == bad:
            expect_error(lambda: epx_torch.Layer(None, hidden=H, top_k=2), "mesh must be an epx_torch.Mesh, not NoneType",
                         error=TypeError)
        else:
            expect_error(lambda: epx_torch.Layer(mesh, hidden=H, top_k=2), "arguments of other ranks",
                         f"rank {bad}: TypeError: mesh must be an epx_torch.Mesh, not NoneType")

    def copy_or_pickle():
        # A module that holds the layer: deepcopy and pickling say what to do instead; a deep
        # copy that shares the layer (memo) computes what the original does.
        import copy
        import io
        import pickle

        block = ScaledBlock(layer)
        expect_error(lambda: copy.deepcopy(block), "cannot be deep-copied", "copy.deepcopy(model, {id(layer): layer})",
                     error=TypeError)
        expect_error(lambda: pickle.dumps(block), "cannot be pickled", "state_dict()", error=TypeError)
        expect_error(lambda: torch.save(block, io.BytesIO()), "cannot be pickled", error=TypeError)
        twin = copy.deepcopy(block, {id(layer): layer})
        if twin.layer is not layer or twin.scale is block.scale:
            raise AssertionError("the copy does not share the layer, or shares the parameters")
        x, ids, w = data()
        with torch.no_grad():
            check_equal("a copy sharing the layer", twin(x, ids, w), block(x, ids, w))
        block.load_state_dict(twin.state_dict())  # the layer has no state of its own

    def combine_twice():
        x, ids, w = data()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        epx_torch.combine(rows, h)
        expect_error(lambda: epx_torch.combine(rows, h), "already combined")

    def group_size_disagrees():
        # A mesh of 2*W ranks over a process group of W.
        m = epx_torch.Mesh(tp=1, fsdp=2 * W, ep=2, experts=4)
        expect_error(lambda: epx_torch.Layer(m, hidden=H, top_k=2), "configuration",
                     f"communicator size ({W}) must equal")

    def subgroup_size_disagrees():
        # A process group of half the job, under a mesh of the whole job and under a mesh of
        # the half: refused on every rank (the mesh's groups are made over the job's ranks).
        halves = [dist.new_group(list(range(0, W // 2))), dist.new_group(list(range(W // 2, W)))]
        mine = halves[rank // (W // 2)]
        for world in (W, W // 2):
            m = epx_torch.Mesh(tp=1, fsdp=world, ep=world, experts=2 * world)
            expect_error(lambda: epx_torch.Layer(m, hidden=H, top_k=2, group=mine),
                         f"the group must hold every rank of the job ({W}); this one holds {W // 2}")

    def backward_twice():
        # One backward per forward through combine: a second one (retain_graph) says so.
        x, ids, w = data()
        x.requires_grad_()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        out = epx_torch.combine(rows * 2, h)
        out.sum().backward(retain_graph=True)
        expect_error(lambda: out.sum().backward(), "combine backward already ran for this dispatch",
                     "retain_graph=True")

    def double_backward():
        # The backward halves carry no graph: a gradient taken through them with
        # create_graph=True is right, and differentiating it again raises, instead of a
        # second derivative that silently leaves epx's part out.
        x, ids, w = data()
        x.requires_grad_()
        w.requires_grad_()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        out = epx_torch.combine(rows * 2, h)
        gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
        check_close("input gradient under create_graph", gx, 2 * w.detach().sum(1, keepdim=True).expand(-1, H), 1e-6)
        expect_error(lambda: torch.autograd.grad(gx.sum(), w), "differentiable once", "create_graph=True",
                     error=RuntimeError)

    def gradients_disagree():
        # The ranks that sum a gradient together (efsdp or fsdp, and dp_replicate) must pass
        # the same size and type: else every one raises, naming them (the sums would read
        # past the smaller block, or gloo would abort the process); the groups work after.
        # The agreement is epx's own (epx/grad/hooks.hpp), which names ranks in the group and
        # by world rank (here the same: efsdp = fsdp = W).
        m = epx_torch.Mesh(tp=1, fsdp=W, ep=1, experts=2)  # efsdp = fsdp = W
        lay = epx_torch.Layer(m, hidden=H, top_k=1)
        g = torch.ones(5 if rank == bad else 4)
        expect_error(lambda: lay.reduce_expert_gradients(g), "reduce_expert_gradients: the ranks disagree",
                     f"rank {bad} of the efsdp group (world rank {bad}) passes a gradient of 5 elements",
                     "but rank 0 (world rank 0) passes 4",
                     "nothing was reduced")
        g = torch.ones(4, dtype=torch.float64 if rank == bad else torch.float32)
        expect_error(lambda: lay.reduce_dense_gradients(g), "reduce_dense_gradients",
                     f"rank {bad} of the fsdp group (world rank {bad}) passes float64 elements",
                     "but rank 0 (world rank 0) passes float32")
        g = torch.ones(4, dtype=torch.bfloat16 if rank == bad else torch.float16)
        expect_error(lambda: lay.reduce_dense_gradients(g), "reduce_dense_gradients",
                     f"rank {bad} of the fsdp group (world rank {bad}) passes bfloat16 elements",
                     "but rank 0 (world rank 0) passes float16")
        # A tensor the hooks cannot take on one rank: the others raise too, naming it.
        g = torch.ones(4, dtype=torch.int64 if rank == bad else torch.float32)
        expect_error(lambda: lay.reduce_dense_gradients(g), "reduce_dense_gradients",
                     f"rank {bad} of the fsdp group (world rank {bad}) cannot reduce its gradient: gradients of dtype Long cannot be "
                     "reduced")
        # None where a gradient goes (a parameter without one on this rank): the same.
        for reduce, hook, group in ((lay.reduce_expert_gradients, "reduce_expert_gradients", "efsdp"),
                                    (lay.reduce_dense_gradients, "reduce_dense_gradients", "fsdp")):
            expect_error(lambda: reduce(None if rank == bad else torch.ones(4)), hook,
                         f"rank {bad} of the {group} group (world rank {bad}) cannot reduce its gradient: the gradient is None",
                         "torch.zeros_like(param)")
        # A parameter itself where its gradient goes (a leaf that requires grad): refused on
        # every rank, and left as it was, instead of changed in place behind autograd.
        p = torch.nn.Parameter(torch.ones(4))
        for reduce, hook, group in ((lay.reduce_expert_gradients, "reduce_expert_gradients", "efsdp"),
                                    (lay.reduce_dense_gradients, "reduce_dense_gradients", "fsdp")):
            for q in (p, torch.nn.Parameter(torch.ones(2, 2).t())):  # contiguous or not
                expect_error(lambda: reduce(q if rank == bad else torch.ones(q.shape)), hook,
                             f"rank {bad} of the {group} group (world rank {bad}) cannot reduce its gradient: the "
                             "gradient is a leaf tensor that requires grad", ".grad")
        check_equal("a parameter handed to a reduction", p.detach(), torch.ones(4))
        g = torch.ones(4)
        expect_error(lambda: lay._impl.reduce_expert_gradients(g[::2] if rank == bad else g[:2]),
                     "reduce_expert_gradients", f"rank {bad} of the efsdp group (world rank {bad}) cannot reduce its gradient: "
                     "the gradient must be a contiguous tensor on cpu")
        p = torch.nn.Parameter(torch.ones(3 if rank == bad else 2))  # a hook on parameters that differ
        handles = lay.register_expert_hooks([p])
        expect_error(lambda: p.sum().backward(), "reduce_expert_gradients",
                     f"rank {bad} of the efsdp group (world rank {bad}) passes a gradient of 3 elements")
        for hd in handles:
            hd.remove()
        g = torch.full((4,), float(rank + 1))
        lay.reduce_expert_gradients(g)
        check_close("expert gradient after the errors", g, torch.full((4,), (W + 1) / 2), 1e-15)

    def out_of_step():
        # Rank `bad` skips a combine (its own code raised between dispatch and combine) and
        # goes on to the next dispatch while the others combine: the records have one size
        # and name the call, so every rank raises, naming both.
        x, ids, w = data()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        call = (lambda: epx_torch.dispatch(x, ids, w, layer)) if rank == bad else (lambda: epx_torch.combine(rows, h))
        expect_error(call, "makes a combine", "makes a training call")

    def grad_mode_mixed():
        # A dispatch without gradients, then a combine that needs them: refused at combine.
        x, ids, w = data()
        with torch.no_grad():
            rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        y = rows.clone().requires_grad_()
        expect_error(lambda: epx_torch.combine(y, h), "epx_torch combine", "ran without them",
                     "same grad mode")

    def meshes_disagree():
        m = epx_torch.Mesh(tp=1, fsdp=W, ep=W if rank != bad else 1, experts=E_DEFAULT)
        expect_error(lambda: epx_torch.Layer(m, hidden=H, top_k=2), "built different meshes",
                     f"rank {bad} has ep=1 but rank 0 has ep={W}")

    def dtypes_disagree():
        expect_error(lambda: epx_torch.Layer(mesh, hidden=H, top_k=2,
                                             dtype=torch.float64 if rank == bad else torch.float32),
                     f"rank {bad} has dtype=torch.float64 but rank 0 has dtype=torch.float32")

    def paths_or_transports_disagree():
        # Named as the Layer's arguments spell them.
        expect_error(lambda: epx_torch.Layer(mesh, hidden=H, top_k=2, path="auto" if rank == bad else "all_to_all"),
                     f"rank {bad} has path='auto' but rank 0 has path='all_to_all'")
        expect_error(lambda: epx_torch.Layer(mesh, hidden=H, top_k=2, transport="group" if rank == bad else "auto"),
                     f"rank {bad} has transport='group' but rank 0 has transport='auto'")

    def devices_disagree():
        # The host and device layers talk through different communicators: a rank with
        # another device raises with the others at once (a group that times out after 10 s:
        # a wait in the layer's agreement fails fast).
        import datetime

        quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=10))
        expect_error(lambda: epx_torch.Layer(mesh, hidden=H, top_k=2, group=quick,
                                             device="emulated" if rank == bad else "cpu"),
                     "passed different devices", f"rank {bad} has device='emulated' but rank 0 has device='cpu'")

    def arguments_wrong_on_one_rank():
        # A rank whose arguments are wrong raises ValueError; the others raise EpxError
        # naming it at once (a group that times out after 10 s: a wait would fail the case).
        import datetime

        quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=10))
        for kwargs, says in (({"path": "sideways"}, "path must be one of"),
                             ({"transport": "pigeon"}, "transport must be one of"),
                             ({"dtype": torch.int32}, "dtype must be one of"),
                             ({"hidden": H + 0.5}, "hidden must be an int"),
                             ({"padding": (1, 1, 1)}, "padding must be (rows_per_expert, align)")):
            args = {"hidden": H, "top_k": 2, "group": quick}
            if rank == bad:
                args.update(kwargs)
            if rank == bad:
                expect_error(lambda: epx_torch.Layer(mesh, **args), says, error=ValueError)
            else:
                expect_error(lambda: epx_torch.Layer(mesh, **args), "arguments of other ranks",
                             f"rank {bad}: ValueError: {says}")
        # Every rank wrong: each raises its own ValueError. A float hidden is never truncated.
        expect_error(lambda: epx_torch.Layer(mesh, hidden=4.5, top_k=2, group=quick), "hidden must be an int, not 4.5",
                     error=ValueError)
        # The group still works: a layer with right arguments builds.
        epx_torch.Layer(mesh, hidden=H, top_k=2, group=quick)

    def masked_needs_ep_eq_tp():
        m = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
        expect_error(lambda: epx_torch.Layer(m, hidden=H, top_k=2, path="all_reduce"),
                     "requires ep_size (", "== tp_size (1)")

    def bad_mesh():
        expect_error(lambda: epx_torch.Layer(epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=W + 1), hidden=H, top_k=2),
                     f"num_experts ({W + 1}) must be divisible by ep_size ({W})")

    def sizes_that_wrap():
        # A row of hidden * 4 bytes beyond PTRDIFF_MAX is refused at construction; padding
        # rows whose expert-major buffer (rows * hidden) would wrap raise at the call, on
        # every rank, though no rank has a token.
        expect_error(lambda: epx_torch.Layer(mesh, hidden=2**62, top_k=2), "hidden (4611686018427387904) is too large")
        big = 2**40
        lay = epx_torch.Layer(mesh, hidden=big, top_k=2, padding=(2**24, 1))
        x, ids, w = torch.zeros(0, big), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2)
        expect_error(lambda: epx_torch.dispatch(x, ids, w, lay), "epx_torch dispatch: the expert-major buffer of ep rank",
                     "padding included")

    def missing_rank_times_out():
        # A rank that never calls dispatch: the others raise once the layer's group timeout
        # (3 s here) has passed, on the shared-memory path as on the process group's (there
        # the group's failure is an EpxError too, naming the collective and the group).
        import datetime

        quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=3))
        lay = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float32, group=quick, transport="shm")
        slow = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=3))
        over_group = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float32, group=slow, transport="group")
        x, ids, w = data()
        if rank != bad:
            expect_error(lambda: epx_torch.dispatch(x, ids, w, lay), "communicator", "waited more than 3")
            expect_error(lambda: epx_torch.dispatch(x, ids, w, over_group), "communicator",
                         "over torch process group", f"(gloo, rank {rank} of {W}) failed")

    def one_rank_fails_in_shared_memory():
        # A failure of one rank alone inside the shared-memory exchange (here: its buffer would
        # pass EPX_TORCH_SHM_MAX_BYTES): every rank raises at once with that rank's reason,
        # rather than waiting out the group's timeout (60 s; a wait would say "waited more
        # than"); the exchange stays failed for later calls.
        import datetime

        g = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=60))
        Hb = 1024
        lay = epx_torch.Layer(mesh, hidden=Hb, top_k=2, dtype=torch.float32, group=g, transport="shm")
        gen = torch.Generator().manual_seed(77 + rank)
        N = 256  # 256 x 2 rows of 4 KiB: 2 MiB sent by each rank, above the 1 MiB limit of one
        x = torch.randn(N, Hb, generator=gen)
        ids = torch.randint(0, E_DEFAULT, (N, 2), generator=gen, dtype=torch.int32)
        w = torch.rand(N, 2, generator=gen)
        if rank == bad:
            os.environ["EPX_TORCH_SHM_MAX_BYTES"] = str(1 << 20)
        try:
            want = ("needs a buffer of", "above EPX_TORCH_SHM_MAX_BYTES=1048576") if rank == bad else (
                f"rank {bad} of the group failed", "above EPX_TORCH_SHM_MAX_BYTES=1048576")
            expect_error(lambda: epx_torch.dispatch(x, ids, w, lay), "shared-memory", *want)
        finally:
            os.environ.pop("EPX_TORCH_SHM_MAX_BYTES", None)
        expect_error(lambda: epx_torch.dispatch(x[:4], ids[:4], w[:4], lay), f"rank {bad}",
                     "above EPX_TORCH_SHM_MAX_BYTES=1048576")

    def id_beyond_int32():
        # int64 ids reach epx as int32: one outside int32's range stays out of range (at
        # int32's limit, which epx names) instead of wrapping around to a valid expert.
        for big, named in ((2**32 + 1, 2**31 - 1), (-2**32 + 2, -2**31)):
            x, ids, w = data()
            if rank == bad:
                ids[4, 1] = big
            expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}",
                         f"expert id ({named}) of token 4 slot 1 out of range [0, {E_DEFAULT})")

    def weights_shape():
        # The routing weights must have x's rows as well as top_k columns.
        for shape in ((5, 2), (7, 2)):
            x, ids, w = data()
            if rank == bad:
                w = torch.rand(*shape)
            expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}",
                         f"routing weights has shape [{shape[0]}, 2] but must be [6, 2]")

    def error_is_runtime_error():
        # EpxError is a RuntimeError (docs/pytorch.md): code that catches RuntimeError catches it.
        if not issubclass(epx_torch.EpxError, RuntimeError):
            raise AssertionError(f"EpxError's bases are {epx_torch.EpxError.__mro__[1:]}, not RuntimeError's")
        x, ids, w = data()
        if rank == bad:
            x = x.double()
        expect_error(lambda: epx_torch.dispatch(x, ids, w, layer), f"rank {bad}", "x has dtype Double",
                     error=RuntimeError)

    def still_works_after_errors():
        layer_case(tp=1, dtype=torch.float64)

    return [("error: wrong x dtype", wrong_dtype), ("error: wrong ids dtype", wrong_ids_dtype),
            ("error: wrong device", wrong_device), ("error: CUDA tensors refused on every rank", cuda_tensors), ("error: wrong x shape", wrong_shape),
            ("error: wrong ids shape", ids_shape), ("error: expert id out of range", bad_expert_id),
            ("error: an int64 expert id outside int32 on one rank", id_beyond_int32),
            ("error: routing weights of the wrong shape", weights_shape),
            ("error: EpxError is a RuntimeError", error_is_runtime_error),
            ("error: NaN routing weight", nan_weight), ("error: combine with a wrong expert output", combine_shape),
            ("error: a handle combined twice", combine_twice),
            ("error: None or another object for a tensor on one rank", not_a_tensor),
            ("error: another object for the layer, the handle or the mesh", not_a_layer_or_handle),
            ("error: a layer is neither deep-copied nor pickled; a copy may share it", copy_or_pickle),
            ("error: process group size disagrees with the mesh", group_size_disagrees),
            ("error: sub-group size disagrees with the mesh", subgroup_size_disagrees),
            ("error: a second backward through combine", backward_twice),
            ("error: double backward (create_graph=True) through dispatch and combine", double_backward),
            ("error: ranks reduce gradients of different sizes or types", gradients_disagree),
            ("error: calls out of step (one rank skipped a combine)", out_of_step),
            ("error: combine needs gradients, its dispatch ran without", grad_mode_mixed),
            ("error: ranks built different meshes", meshes_disagree),
            ("error: ranks built different dtypes", dtypes_disagree),
            ("error: ranks chose different paths or transports", paths_or_transports_disagree),
            ("error: ranks passed different devices", devices_disagree),
            ("error: wrong arguments on one rank", arguments_wrong_on_one_rank),
            ("error: masked path needs ep == tp", masked_needs_ep_eq_tp),
            ("error: mesh rule (experts % ep)", bad_mesh),
            ("error: a hidden size or padding whose buffers would wrap", sizes_that_wrap),
            ("error: a rank that never calls: the others time out", missing_rank_times_out),
            ("error: one rank fails inside the shared-memory exchange: every rank raises its reason",
             one_rank_fails_in_shared_memory),
            ("after errors the group still works", still_works_after_errors)]


# ---- the communicator -------------------------------------------------------------------

def communicator_case(kind="_Communicator"):
    """The communicator's collectives (kind: "_Communicator", host memory, or
    "_EmulatedCommunicator", the device communicator on the emulated device)."""
    W, rank = dist.get_world_size(), dist.get_rank()
    c = getattr(epx_torch._C, kind)(dist.group.WORLD.group_name, rank, W)
    assert c.rank() == rank and c.size() == W
    # all_reduce: the sum in rank order with the scale before the one rounding, the same bits
    # on every rank.
    v = torch.tensor([0.1 * (rank + 1), 1e8 if rank == 0 else 1.0, -1e8 if rank == 1 else 0.5], dtype=torch.float32)
    want = v.clone()
    allv = [torch.empty_like(v) for _ in range(W)]
    dist.all_gather(allv, v)
    acc = allv[0].clone()
    for r in range(1, W):
        acc = acc + allv[r]
    want = (acc * 0.25)
    c.all_reduce(v, 0.25)
    check_equal("all_reduce", v, want)
    got = [torch.empty_like(v) for _ in range(W)]
    dist.all_gather(got, v)
    for r in range(W):
        check_equal(f"all_reduce on rank {r}", got[r], v)
    # reduce_scatter: block r summed over ranks lands on rank r.
    send = torch.arange(2 * W, dtype=torch.float64) + 100 * rank
    recv = torch.empty(2, dtype=torch.float64)
    c.reduce_scatter(send, recv, 0.5)
    want = torch.tensor([2 * rank, 2 * rank + 1], dtype=torch.float64) * W + 100 * sum(range(W))
    check_equal("reduce_scatter", recv, want * 0.5)
    # all_to_allv with unpacked displacements.
    sc = [1] * W
    sd = [2 * p for p in range(W)]
    src = torch.tensor([float(rank * 10 + p // 2) if p % 2 == 0 else -1.0 for p in range(2 * W)])
    dst = torch.full((2 * W,), -7.0)
    c.all_to_allv(src, sc, sd, dst, [1] * W, [2 * p + 1 for p in range(W)])
    for p in range(W):
        assert dst[2 * p + 1].item() == p * 10 + rank and dst[2 * p].item() == -7.0
    # broadcast, barrier, split.
    b = torch.full((3,), float(rank), dtype=torch.float32)
    c.broadcast(b, W - 1)
    check_equal("broadcast", b, torch.full((3,), float(W - 1)))
    c.barrier()
    sub = c.split(rank % 2, rank)
    members = [r for r in range(W) if r % 2 == rank % 2]
    assert sub.size() == len(members), (sub.size(), members)
    assert sub.rank() == members.index(rank), (sub.rank(), members)
    # A torch group numbers its members by job rank: keys that reorder them are refused.
    expect_error(lambda: c.split(0, -rank), "configuration", "order its members differently")
    t = torch.tensor([float(rank)])
    sub.all_reduce(t, 1.0)
    assert t.item() == float(sum(members))


def unused_rows_case(device="cpu"):
    """Experts that return a constant on a rank that received no rows (padding off, every
    token routed to rank 0's expert 0), without reading the rows: dispatch's backward, a
    collective, still runs on every rank, and every rank gets its input gradient (its tokens
    went to rank 0's expert). The layer's group times out after 20 s, so that a rank left
    waiting fails fast."""
    import datetime

    W, rank = dist.get_world_size(), dist.get_rank()
    quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=20))
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=1, dtype=torch.float64, padding=(0, 1), group=quick, device=device)
    A = torch.randn(H, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    A_loc = torch.nn.Parameter(A.expand(layer.local_experts, H, H).clone())
    g = torch.Generator().manual_seed(500 + rank)
    N = 5
    x = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(N, 1, dtype=torch.int64)
    w = torch.rand(N, 1, generator=g, dtype=torch.float64).float().requires_grad_()
    G = torch.randn(N, H, generator=g, dtype=torch.float64)
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    if rows.shape[0] == 0:
        y = rows.new_zeros(0, H)  # nothing to compute here
    else:
        y = torch.cat([rows[int(offsets[l]):int(offsets[l + 1])] @ A_loc[l] for l in range(layer.local_experts)])
    out = epx_torch.combine(y, handle)
    out.backward(G)
    xd, wd = x.detach(), w.detach().double()
    check_close("output", out, wd * (xd @ A), 1e-12)
    if x.grad is None:
        raise AssertionError("no input gradient on this rank: dispatch's backward did not run")
    check_close("input gradient", x.grad, wd * (G @ A.t()), 1e-12)
    check_close("routing-weight gradient", w.grad, (G * (xd @ A)).sum(1, keepdim=True), 1.2e-7)


def unused_expert_hook_case(device="cpu", dp_replicate=1):
    """Expert hooks on a rank whose experts received no rows and were skipped (padding off,
    every token routed to rank 0's expert 0): its expert parameters get no gradient in this
    backward, yet the reduction over efsdp runs on every rank at the end of backward (a
    zero gradient for that rank's parameters), so that no rank waits for it. The layer's
    group times out after 20 s, so that a rank left waiting fails fast."""
    import datetime

    W, rank = dist.get_world_size(), dist.get_rank()
    quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=20))
    # Every rank holds both experts: efsdp * dp_replicate = W = B.
    mesh = epx_torch.Mesh(tp=1, fsdp=W // dp_replicate, ep=1, dp_replicate=dp_replicate, experts=2)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=1, dtype=torch.float64, padding=(0, 1), group=quick, device=device)
    A = torch.randn(H, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    A_loc = torch.nn.Parameter(A.expand(layer.local_experts, H, H).clone())
    handles = layer.register_expert_hooks([A_loc])
    N = 3 if rank == 0 else 0  # only rank 0 has tokens: the other ranks' experts get no rows
    g = torch.Generator().manual_seed(600 + rank)
    x = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(N, 1, dtype=torch.int64)
    w = torch.ones(N, 1, requires_grad=True)
    G = torch.randn(N, H, generator=g, dtype=torch.float64)
    for step in range(2):  # twice: the reduction is queued again in every backward
        A_loc.grad = None
        rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
        if rows.shape[0] == 0:
            y = rows.new_zeros(0, H)  # skipped: the experts' parameters get no gradient
        else:
            y = torch.cat([rows[int(offsets[l]):int(offsets[l + 1])] @ A_loc[l] for l in range(layer.local_experts)])
        out = epx_torch.combine(y, handle)
        out.backward(G)
        # Rank 0's gradient of expert 0 (x^T G), summed over efsdp and dp_replicate (W ranks)
        # and divided by B = W.
        want = torch.zeros_like(A_loc)
        gen = torch.Generator().manual_seed(600)
        x0 = torch.randn(3, H, generator=gen, dtype=torch.float64)
        G0 = torch.randn(3, H, generator=gen, dtype=torch.float64)
        want[0] = x0.t() @ G0 / W
        if A_loc.grad is None:
            raise AssertionError(f"step {step}: no expert gradient on this rank after the hook")
        check_close(f"step {step}: expert gradient (sum over efsdp / B)", A_loc.grad, want, 1e-12)
    # A backward that raises in combine's backward (a second one through the same combine)
    # leaves nothing behind: the next backward reduces again.
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    out = epx_torch.combine(rows.new_zeros(0, H) if rows.shape[0] == 0 else rows @ A_loc[0], handle)
    out.backward(G, retain_graph=True)
    expect_error(lambda: out.backward(G), "combine backward already ran for this dispatch")
    A_loc.grad = None
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    epx_torch.combine(rows.new_zeros(0, H) if rows.shape[0] == 0 else rows @ A_loc[0], handle).backward(G)
    if A_loc.grad is None:
        raise AssertionError("after a backward that raised: no expert gradient on this rank")
    check_close("after a backward that raised: expert gradient", A_loc.grad, want, 1e-12)
    # torch.autograd.grad accumulates no gradient: the ranks agree to reduce nothing.
    A_loc.grad = None
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    out = epx_torch.combine(rows.new_zeros(0, H) if rows.shape[0] == 0 else rows @ A_loc[0], handle)
    torch.autograd.grad(out, x, G)
    if A_loc.grad is not None:
        raise AssertionError(f"torch.autograd.grad left an expert gradient: {A_loc.grad}")
    for hd in handles:
        hd.remove()
    # Without hooks nothing is reduced: the gradient stays None on the ranks without rows.
    A_loc.grad = None
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    y = rows.new_zeros(0, H) if rows.shape[0] == 0 else rows @ A_loc[0]
    epx_torch.combine(y, handle).backward(G)
    if (A_loc.grad is None) != (rank != 0):
        raise AssertionError(f"after remove(): the gradient is {A_loc.grad}")


def checkpoint_hook_case(use_reentrant: bool, ep: int = 1, scope: str = "layer", device: str = "cpu",
                         skip: bool = True, wdtype=torch.float32):
    """Activation checkpointing (torch.utils.checkpoint, reentrant or not) around a part of
    the MoE layer, with expert hooks: the whole layer (scope "layer": dispatch, experts,
    combine), the experts alone ("experts"), dispatch and the experts without combine
    ("dispatch"), dispatch alone ("dispatch alone"), or combine alone ("combine", which is
    not supported: every rank must raise EpxError saying so, in backward, where the
    checkpoint recomputes combine on a handle already combined; then a step without
    checkpointing runs as before). With `skip`, only rank 0 has tokens, all routed to expert
    0 (padding off): the experts of every other rank receive no rows and are skipped (their
    output is the rows themselves, no parameter read), so that their parameters get no
    gradient there; without it every rank has a token for every expert. The routing weights
    are of `wdtype` (float32, or converted to it in dispatch). Every gradient (expert
    parameters after the hook, a dense parameter before the layer after its hook, the input
    and the routing weights) must equal, bit for bit, those of the same steps without
    checkpointing, and no rank may wait for another: the layer's group times out after 30 s."""
    import datetime

    from torch.utils.checkpoint import checkpoint

    W, rank = dist.get_world_size(), dist.get_rank()
    quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=30))
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=ep, experts=2 * ep)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=1, dtype=torch.float64, padding=(0, 1), group=quick, device=device)
    gen = torch.Generator().manual_seed(11)
    A = torch.randn(layer.local_experts, H, H, generator=gen, dtype=torch.float64) / math.sqrt(H)
    A_loc = torch.nn.Parameter(A + layer.first_expert)
    s = torch.nn.Parameter(torch.linspace(0.5, 1.5, H, dtype=torch.float64))  # a dense weight before the layer
    handles = layer.register_expert_hooks([A_loc]) + layer.register_dense_hooks([s])
    N = (3 if rank == 0 else 0) if skip else 2 * ep
    g = torch.Generator().manual_seed(700 + rank)
    x0 = torch.randn(N, H, generator=g, dtype=torch.float64)
    w0 = torch.rand(N, 1, generator=g, dtype=torch.float64).to(wdtype)
    G = torch.randn(N, H, generator=g, dtype=torch.float64)
    # Every token to expert 0 (skip), or token t to expert t: each rank's experts get rows.
    ids = torch.zeros(N, 1, dtype=torch.int64) if skip else torch.arange(N, dtype=torch.int64)[:, None]

    def experts(rows, offsets):
        if rows.shape[0] == 0:
            return rows  # skipped: no row, no parameter read
        return torch.cat([rows[int(offsets[l]):int(offsets[l + 1])] @ A_loc[l] for l in range(layer.local_experts)
                          if int(offsets[l + 1]) > int(offsets[l])])

    def dispatch_experts(h, w):
        rows, offsets, handle = epx_torch.dispatch(h, ids, w, layer)
        return experts(rows, offsets), handle

    def moe(h, w, ckpt: bool):
        part = (lambda f, *a: checkpoint(f, *a, use_reentrant=use_reentrant)) if ckpt else (lambda f, *a: f(*a))
        if ckpt and scope == "layer":
            return checkpoint(moe, h, w, False, use_reentrant=use_reentrant)
        if scope == "dispatch":
            y, handle = part(dispatch_experts, h, w)
            return epx_torch.combine(y, handle)
        rows, offsets, handle = part(lambda h, w: epx_torch.dispatch(h, ids, w, layer), h, w) \
            if scope == "dispatch alone" else epx_torch.dispatch(h, ids, w, layer)
        y = part(experts, rows, offsets) if scope == "experts" else experts(rows, offsets)
        return part(epx_torch.combine, y, handle) if scope == "combine" else epx_torch.combine(y, handle)

    def step(ckpt: bool):
        for p in (A_loc, s):
            p.grad = None
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        out = moe(x * s, w, ckpt)
        out.backward(G)
        return [t.grad.clone() if t.grad is not None else None for t in (A_loc, s, x, w)]

    want = step(False)  # no checkpoint anywhere
    if scope == "combine":
        expect_error(lambda: step(True), "already combined", "around combine without its dispatch is not supported")
        got = step(False)  # nothing left behind: the next step reduces as before
        for name, a, b in zip(("expert gradient", "dense gradient", "input gradient", "routing-weight gradient"),
                              got, want):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                raise AssertionError(f"after the refused checkpoint: {name} differs")
        for hd in handles:
            hd.remove()
        return
    for i in range(2):  # twice: the reductions are queued again in every backward
        got = step(True)
        for name, a, b in zip(("expert gradient (after the hook)", "dense gradient (after the hook)",
                               "input gradient", "routing-weight gradient"), got, want):
            if a is None and b is None:
                continue  # no rank of its group got a gradient (efsdp 1): none is reduced, with or without
            if a is None or b is None:
                raise AssertionError(f"step {i}: {name}: {'no gradient' if a is None else 'one'} with checkpointing, "
                                     f"{'none' if b is None else 'one'} without")
            check_equal(f"step {i}: {name}", a, b)
    for hd in handles:
        hd.remove()


def checkpoint_tp_case(use_reentrant: bool, path: str, scope: str = "dispatch"):
    """Activation checkpointing around dispatch and the experts without combine (scope
    "dispatch") or around the whole layer ("layer"), with tp 2 (the ranks of a TP group hold
    the same rows and dispatch their slices) on the all-to-all path, the masked path, or
    "auto" (masked for calls without gradients, ep == tp): the output and every gradient
    (the expert parameters after the hook, the input, the routing weights) equal, bit for
    bit, those of the same step without checkpointing."""
    import datetime

    from torch.utils.checkpoint import checkpoint

    W = dist.get_world_size()
    quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=30))
    mesh = epx_torch.Mesh(tp=2, fsdp=W // 2, ep=2, experts=4)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float64, path=path, group=quick)
    x0, ids, w0, G = batch_data(layer.batch, 6, 2, 4, torch.float64)
    gen = torch.Generator().manual_seed(13 + layer.first_expert)
    A = torch.nn.Parameter(torch.randn(layer.local_experts, H, H, generator=gen, dtype=torch.float64) / math.sqrt(H))
    handles = layer.register_expert_hooks([A])

    def experts(rows, offsets):
        return torch.cat([rows[int(offsets[l]):int(offsets[l + 1])] @ A[l] for l in range(layer.local_experts)])

    def dispatch_experts(h, w):
        rows, offsets, handle = epx_torch.dispatch(h, ids, w, layer)
        return experts(rows, offsets), handle

    def moe(h, w):
        return epx_torch.combine(*dispatch_experts(h, w))

    def step(ckpt: bool):
        A.grad = None
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if ckpt and scope == "layer":
            out = checkpoint(moe, x, w, use_reentrant=use_reentrant)
        elif ckpt:
            out = epx_torch.combine(*checkpoint(dispatch_experts, x, w, use_reentrant=use_reentrant))
        else:
            out = moe(x, w)
        out.backward(G)
        return [out.detach(), A.grad.clone(), x.grad.clone(), w.grad.clone()]

    want = step(False)
    got = step(True)
    for name, a, b in zip(("output", "expert gradient (after the hook)", "input gradient", "routing-weight gradient"),
                          got, want):
        check_equal(name, a, b)
    for hd in handles:
        hd.remove()


def no_grad_training_case():
    """Under torch.no_grad (a reentrant activation checkpoint's forward), a dispatch whose x
    or weights require grad keeps what backward needs (path "auto" then takes the
    all-to-all path, as the recomputation with gradients will), one whose inputs need no
    gradient does not, nor one under torch.inference_mode; and a training dispatch's handle
    combined under torch.no_grad combines as for inference, keeping nothing of the experts'
    output, with the same output bits as a combine with gradients, which keeps it until its
    backward."""
    W = dist.get_world_size()
    tp = 2 if W % 2 == 0 else 1
    mesh = epx_torch.Mesh(tp=tp, fsdp=W // tp, ep=tp, experts=2 * tp)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float64, path="auto")
    x, ids, w, G = batch_data(layer.batch, 6, 2, 2 * tp, torch.float64)

    def state(x, w):
        return epx_torch.dispatch(x, ids, w, layer)

    with torch.no_grad():
        for xg, wg, training in ((True, False, True), (False, True, True), (False, False, False)):
            rows, offsets, h = state(x.clone().requires_grad_(xg), w.clone().requires_grad_(wg))
            if h.state.training != training or h.state.masked == training:
                raise AssertionError(f"no_grad, x requires grad {xg}, weights {wg}: training {h.state.training}, "
                                     f"masked {h.state.masked}")
            if training:
                out_no_grad = epx_torch.combine(rows * 2, h)
                if h.state.keeps_output:
                    raise AssertionError("a combine under no_grad kept the experts' output")
    with torch.inference_mode():
        _, _, h = state(x.clone().requires_grad_(), w)
        if h.state.training:
            raise AssertionError("a dispatch under inference_mode kept what backward needs")
    xr = x.clone().requires_grad_()
    rows, offsets, h = state(xr, w)
    out = epx_torch.combine(rows * 2, h)
    if not h.state.keeps_output:
        raise AssertionError("a combine with gradients did not keep the experts' output")
    check_equal("output of a combine under no_grad", out_no_grad, out.detach())
    out.backward(G)
    if h.state.keeps_output:
        raise AssertionError("combine's backward left the experts' output in the handle")


def constant_experts_case(device="cpu"):
    """Neither x nor the routing weights require grad, and a rank whose experts received no
    rows returns a constant: combine's output still requires grad on every rank (the
    dispatch ran with gradients enabled), so that backward runs combine's backward, a
    collective, on every rank instead of raising on that rank only while the others wait."""
    import datetime

    W, rank = dist.get_world_size(), dist.get_rank()
    quick = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=20))
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=1, dtype=torch.float64, padding=(0, 1), group=quick, device=device)
    A = torch.nn.Parameter(torch.randn(H, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    N = 4
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(700 + rank), dtype=torch.float64)
    ids = torch.zeros(N, 1, dtype=torch.int64)  # every token to rank 0's expert 0
    w = torch.ones(N, 1)
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    y = rows @ A if rank == 0 else rows.new_zeros(rows.shape[0], H)  # a constant where no rows came
    out = epx_torch.combine(y, handle)
    if not out.requires_grad:
        raise AssertionError("combine's output does not require grad")
    out.sum().backward()
    if rank == 0:
        want = sum(torch.randn(N, H, generator=torch.Generator().manual_seed(700 + r), dtype=torch.float64).sum(0)
                   for r in range(W))
        check_close("expert gradient", A.grad, want[:, None].expand(H, H), 1e-12)


def dense_hook_case():
    W, rank = dist.get_world_size(), dist.get_rank()
    mesh = epx_torch.Mesh(tp=2 if W % 2 == 0 else 1, fsdp=W // 2 if W % 2 == 0 else W, ep=W, experts=W)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=1)
    p = torch.nn.Parameter(torch.zeros(4))
    layer.register_dense_hooks([p])
    (p * float(layer.batch + 1)).sum().backward()
    want = sum(range(1, mesh.batches + 1)) / mesh.batches
    check_close("dense gradient mean", p.grad, torch.full((4,), want), 1e-15)


def noncontiguous_hook_case():
    """Hooks and reductions on a gradient that is not contiguous (a transposed or
    channels_last parameter's): reduced in a copy, copied back, as for a contiguous one."""
    W, rank = dist.get_world_size(), dist.get_rank()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=W)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=1)
    p = torch.nn.Parameter(torch.zeros(3, 4).t())  # [4, 3], strides (1, 4)
    conv = torch.nn.Parameter(torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last))
    layer.register_dense_hooks([p, conv])
    ((p * float(rank + 1)).sum() + (conv * float(rank + 1)).sum()).backward()
    want = sum(range(1, W + 1)) / W
    if p.grad.is_contiguous() and conv.grad.is_contiguous():
        raise AssertionError("the test's gradients are contiguous")
    check_close("transposed gradient mean", p.grad, torch.full((4, 3), want), 1e-15)
    check_close("channels_last gradient mean", conv.grad, torch.full((2, 3, 4, 4), want), 1e-15)
    g = torch.full((5, 2), float(rank + 1)).t()
    layer.reduce_expert_gradients(g)
    check_close("transposed expert gradient (sum over efsdp 1 / B)", g, torch.full((2, 5), (rank + 1) / W), 1e-15)


def masked_in_place_case():
    """The masked path's backward reads the experts' output itself: changing it in place
    after combine raises torch's in-place error (as the all-to-all path, which keeps a copy,
    gives the right gradient)."""
    mesh = epx_torch.Mesh(tp=2, fsdp=dist.get_world_size() // 2, ep=2, experts=4)
    for path in ("all_reduce", "all_to_all"):
        layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float64, path=path)
        x, ids, w, _ = batch_data(layer.batch, 6, 2, 4, torch.float64)
        w.requires_grad_()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        y = rows * 3.0
        out = epx_torch.combine(y, h)
        y.mul_(0)
        if path == "all_reduce":
            expect_error(lambda: out.sum().backward(), "modified by an inplace operation", error=RuntimeError)
        else:
            out.sum().backward()
            ref = (x.unsqueeze(1).expand(-1, 2, -1) * 3.0).sum(-1)  # <y, grad_out> per slot, grad_out = 1
            check_close("routing-weight gradient after an in-place change (all_to_all keeps a copy)", w.grad,
                        ref.float(), 1e-6)


def reinit_case():
    """The job destroys its process groups and initialises new ones (torch's group names
    start again at "0"), then makes groups of its own, which take the old names: a new Layer
    makes new groups and a new shared-memory exchange, not the ones of the old names."""
    import datetime

    W, rank = dist.get_world_size(), dist.get_rank()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=2 * W)
    epx_torch.Layer(mesh, hidden=H, top_k=2)  # groups and an exchange under the old names
    path = os.path.join("/tmp", f"epx-torch-reinit-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{W}")
    dist.barrier()
    dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=float(os.environ.get("EPX_TORCH_TIMEOUT", "300")))
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=W, timeout=timeout)
    _ = [dist.new_group(list(range(W))) for _ in range(W)]  # the user's own groups, with the old names
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2)
    g = torch.full((4,), float(rank + 1))
    layer.reduce_expert_gradients(g)  # efsdp 1, B = W: g / W
    check_close("expert gradient after the new init", g, torch.full((4,), (rank + 1) / W), 1e-15)
    layer_case(tp=1, dtype=torch.float64)  # a whole layer, through a new shared-memory exchange
    layer_case(tp=1, dtype=torch.float32, transport="group")


def weights_dtype_case(device="cpu"):
    """Routing weights of another float dtype (float64, bfloat16) are converted to float32
    differentiably: their gradient comes back in their own dtype, the float32 weights'
    gradient converted."""
    W = dist.get_world_size()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=3, dtype=torch.float64, device=device)
    x, ids, w, G = batch_data(layer.batch, 12, 3, E_DEFAULT, torch.float64)
    w = w.to(torch.bfloat16).float()  # exact in every dtype below
    grads = {}
    for wd in (torch.float32, torch.float64, torch.bfloat16):
        wi = w.to(wd).detach().clone().requires_grad_()
        rows, offsets, h = epx_torch.dispatch(x, ids, wi, layer)
        epx_torch.combine(rows * 2, h).backward(G)
        if wi.grad is None or wi.grad.dtype != wd:
            raise AssertionError(f"routing weights of {wd}: gradient {None if wi.grad is None else wi.grad.dtype}")
        grads[wd] = wi.grad
    check_equal("float64 routing weights' gradient", grads[torch.float64], grads[torch.float32].double())
    check_equal("bfloat16 routing weights' gradient", grads[torch.bfloat16], grads[torch.float32].bfloat16())


def auto_path_case():
    """path='auto' with ep == tp takes the masked path for a call without gradients and the
    all-to-all path for one with them (docs/pytorch.md), each with the right output (and
    input gradient)."""
    W = dist.get_world_size()
    mesh = epx_torch.Mesh(tp=W, fsdp=1, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float64, path="auto")
    if layer.uses_masked_path(training=True) or not layer.uses_masked_path(training=False):
        raise AssertionError("uses_masked_path: masked for training, or not for inference")
    x, ids, w, G = batch_data(layer.batch, 6, 2, E_DEFAULT, torch.float64)
    for train in (False, True):
        with torch.set_grad_enabled(train):
            xi = x.clone().requires_grad_(train)
            rows, offsets, h = epx_torch.dispatch(xi, ids, w, layer)
            if h.masked == train:
                raise AssertionError(f"a call {'with' if train else 'without'} gradients took the "
                                     f"{'masked' if h.masked else 'all-to-all'} path")
            out = epx_torch.combine(rows * 2, h)
        check_close("output", out, 2 * (w.double().sum(1, keepdim=True) * x), 1e-12)
        if train:
            out.backward(G)
            check_close("input gradient", xi.grad, 2 * w.double().sum(1, keepdim=True) * G, 1e-12)


def noncontiguous_inputs_case(device="cpu"):
    """x, int32 expert ids and float32 routing weights given as non-contiguous views (a
    transposed layout, a column slice) give the bits of the same values in contiguous
    tensors: output, input and routing-weight gradients."""
    W = dist.get_world_size()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=3, dtype=torch.float32, device=device)
    x, ids, w, G = batch_data(layer.batch, 12, 3, E_DEFAULT, torch.float32)
    ids = ids.to(torch.int32)
    views = (x.t().contiguous().t(), ids.t().contiguous().t(), torch.cat([w, torch.zeros_like(w)], 1)[:, :3])
    got = []
    for xi, ii, wi in ((x, ids, w), views):
        if xi is not x and (xi.is_contiguous() or ii.is_contiguous() or wi.is_contiguous()):
            raise AssertionError("the views are contiguous")
        xi = xi.detach().requires_grad_()
        wi = wi.detach().requires_grad_()
        rows, offsets, h = epx_torch.dispatch(xi, ii, wi, layer)
        out = epx_torch.combine(rows * 2, h)
        out.backward(G)
        got.append((rows.detach().clone(), out.detach(), xi.grad, wi.grad))
    for what, a, b in zip(("rows", "output", "input gradient", "routing-weight gradient"), got[0], got[1]):
        check_equal(f"{what} of non-contiguous inputs", b, a)


def held_tensors_case(device="cpu"):
    """What a call returns stays as it was while it is held: the rows and output of one call,
    and the gradients its backward left in x and the routing weights, are not overwritten by
    the layer's next call (the layer hands a buffer out again only once nothing holds it)."""
    W = dist.get_world_size()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=3, dtype=torch.float32, device=device)
    held, copies = [], []
    for call in range(2):
        x, ids, w, G = batch_data(layer.batch + 10 * call, 12, 3, E_DEFAULT, torch.float32)
        x.requires_grad_()
        w.requires_grad_()
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        out = epx_torch.combine(rows * 2, h)
        out.backward(G)
        held.append((rows, out, x.grad, w.grad))
        copies.append(tuple(t.detach().clone() for t in held[-1]))
    for what, t, c in zip(("rows", "output", "input gradient", "routing-weight gradient"), held[0], copies[0]):
        check_equal(f"the first call's {what} after the second call", t.detach(), c)


def removed_hook_case():
    """A hook removed with its handle no longer reduces its parameter's gradient: after a
    backward that parameter holds this rank's own gradient, while the one still hooked holds
    its reduction."""
    W = dist.get_world_size()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float64)
    L = layer.local_experts
    x, ids, w, G = batch_data(layer.batch, 6, 2, E_DEFAULT, torch.float64)

    def step(hooked):
        a = torch.nn.Parameter(torch.linspace(0.5, 1.5, L, dtype=torch.float64))
        b = torch.nn.Parameter(torch.linspace(2.0, 1.0, L, dtype=torch.float64))
        handles = layer.register_expert_hooks([a, b]) if hooked else []
        if hooked:
            handles[0].remove()  # a's
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        le = h.local_expert_ids()
        epx_torch.combine(rows * (a[le] * b[le])[:, None], h).backward(G)
        for hd in handles[1:]:
            hd.remove()
        return a.grad, b.grad

    ga, gb = step(False)
    ha, hb = step(True)
    check_equal("the gradient of a parameter whose hook was removed", ha, ga)
    check_equal("the gradient of a parameter still hooked", hb, layer.reduce_expert_gradients(gb.clone()))


def hook_arguments_case():
    """register_*_hooks take the parameters or one of them; a parameter already hooked on the
    layer (by either kind: its gradient would be reduced twice), a tensor that is not a leaf
    requiring grad, or another object raises at once, before the call hooks anything: after
    the refused calls a parameter hooked once holds its reduction, one never hooked its own
    gradient."""
    W = dist.get_world_size()
    mesh = epx_torch.Mesh(tp=1, fsdp=W, ep=W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=2, dtype=torch.float64)
    L = layer.local_experts
    x, ids, w, G = batch_data(layer.batch, 6, 2, E_DEFAULT, torch.float64)

    def refused(a, b):
        handles = layer.register_expert_hooks(a)  # one parameter, not a list
        assert len(handles) == 1, handles
        for again in (layer.register_expert_hooks, layer.register_dense_hooks):
            expect_error(lambda: again([b, a]), "parameter 1 is already hooked on this layer (register_expert_hooks)",
                         "reduced twice", error=ValueError)
        expect_error(lambda: layer.register_dense_hooks([b, b]), "register_dense_hooks: parameter 1 is already hooked",
                     error=ValueError)
        for t in (b * 2, torch.ones(L, dtype=torch.float64)):
            expect_error(lambda: layer.register_expert_hooks([t]),
                         "register_expert_hooks: parameter 0 must be a leaf tensor that requires grad", error=ValueError)
        expect_error(lambda: layer.register_expert_hooks([None]), "parameter 0 is a NoneType, not a tensor",
                     error=TypeError)
        return handles

    def step(hook):
        a = torch.nn.Parameter(torch.linspace(0.5, 1.5, L, dtype=torch.float64))
        b = torch.nn.Parameter(torch.linspace(2.0, 1.0, L, dtype=torch.float64))
        handles = hook(a, b)
        rows, offsets, h = epx_torch.dispatch(x, ids, w, layer)
        le = h.local_expert_ids()
        epx_torch.combine(rows * (a[le] * b[le])[:, None], h).backward(G)
        for hd in handles:
            hd.remove()
        return a.grad, b.grad

    ga, gb = step(lambda a, b: [])
    ha, hb = step(refused)
    check_equal("a parameter hooked once, then refused twice", ha, layer.reduce_expert_gradients(ga.clone()))
    check_equal("a parameter that only refused calls named", hb, gb)


def cases(W: int):
    out = []
    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    add = lambda name, fn: out.append((name, fn))  # noqa: E731
    add("communicator over the process group", communicator_case)
    add("device communicator over the process group (emulated)", lambda: communicator_case("_EmulatedCommunicator"))
    for dt in (f64, f32, bf16, f16):
        add(f"all_to_all tp1 ep{W} {dt}", lambda dt=dt: layer_case(tp=1, dtype=dt))
    add("all_to_all inference (no_grad)", lambda: layer_case(tp=1, train=False))
    add("all_to_all padding off", lambda: layer_case(padding=(0, 1), routing="first_half"))
    add("all_to_all padding 2 rows, align 4", lambda: layer_case(padding=(2, 4), check_padding=True))
    add("all_to_all one expert takes every token", lambda: layer_case(routing="one_expert"))
    add("all_to_all experts of upper ranks get nothing", lambda: layer_case(routing="first_half"))
    add("routing weights of float64 and bfloat16: their gradient in their dtype", weights_dtype_case)
    add("non-contiguous x, int32 ids and routing weights: the bits of contiguous ones", noncontiguous_inputs_case)
    add("a call's rows, output and gradients, held, survive the next call", held_tensors_case)
    add("dense gradient hook", dense_hook_case)
    add("a removed expert hook no longer reduces its parameter's gradient", removed_hook_case)
    add("hooks refuse a parameter hooked twice, a non-leaf, and take one parameter", hook_arguments_case)
    add("hooks on gradients that are not contiguous", noncontiguous_hook_case)
    # The process group's own all-to-all (transport='group') instead of shared memory.
    add("transport group: all_to_all float64", lambda: layer_case(transport="group"))
    add("transport group: all_to_all float32, padding 2 rows align 4",
        lambda: layer_case(dtype=f32, padding=(2, 4), transport="group"))
    add("transport shm required", lambda: layer_case(dtype=f32, transport="shm"))
    if W >= 2:
        add("all_to_all tp2 (TP slicing)", lambda: layer_case(tp=2, dtype=f64))
        add("all_to_all tp2 float32", lambda: layer_case(tp=2, dtype=f32))
        add("all_to_all tp2 one-token decode (empty slice)", lambda: layer_case(tp=2, N=1))
        add("all_reduce (masked) ep == tp == 2", lambda: layer_case(tp=2, ep=2, path="all_reduce"))
        add("all_reduce (masked) float32", lambda: layer_case(tp=2, ep=2, path="all_reduce", dtype=f32))
        add("all_reduce (masked) float16", lambda: layer_case(tp=2, ep=2, path="all_reduce", dtype=f16))
        add("an expert output changed in place after combine", masked_in_place_case)
        add("experts that do not read the rows on a rank that received none", unused_rows_case)
        add("expert hooks on a rank whose experts received no rows", unused_expert_hook_case)
        add("expert hooks on a rank whose experts received no rows, dp_replicate 2",
            lambda: unused_expert_hook_case(dp_replicate=2))
        add("experts that return a constant, no input requires grad", constant_experts_case)
        add("a training dispatch under no_grad (a reentrant checkpoint's forward); its combine under no_grad keeps "
            "nothing", no_grad_training_case)
        for reentrant in (True, False):
            for ep, scope in ((1, "layer"), (W, "layer"), (1, "experts")) + (((2, "layer"), (2, "experts"))
                                                                            if W >= 4 else ()):
                add(f"activation checkpointing (use_reentrant={reentrant}, around the {scope}, ep{ep}): expert hooks "
                    f"on a rank whose experts received no rows",
                    lambda r=reentrant, e=ep, sc=scope: checkpoint_hook_case(r, ep=e, scope=sc))
            for ep in (1, W):
                for skip in (True, False):
                    what = "on a rank whose experts received no rows" if skip else "on every rank's experts"
                    add(f"activation checkpointing (use_reentrant={reentrant}, around dispatch and the experts, "
                        f"ep{ep}): expert hooks {what}",
                        lambda r=reentrant, e=ep, sk=skip: checkpoint_hook_case(
                            r, ep=e, scope="dispatch", skip=sk, wdtype=torch.float32 if sk else torch.float64))
                    add(f"activation checkpointing (use_reentrant={reentrant}, around combine alone, ep{ep}): refused "
                        f"on every rank, {what}",
                        lambda r=reentrant, e=ep, sk=skip: checkpoint_hook_case(r, ep=e, scope="combine", skip=sk))
            add(f"activation checkpointing (use_reentrant={reentrant}, around dispatch alone, ep{W}): expert hooks "
                f"on a rank whose experts received no rows",
                lambda r=reentrant: checkpoint_hook_case(r, ep=W, scope="dispatch alone"))
            if W % 2 == 0:
                for path in ("all_to_all", "all_reduce", "auto"):
                    add(f"activation checkpointing (use_reentrant={reentrant}, around dispatch and the experts, "
                        f"tp2 ep2, path {path}): bitwise the gradients without it",
                        lambda r=reentrant, p=path: checkpoint_tp_case(r, p))
                add(f"activation checkpointing (use_reentrant={reentrant}, around the layer, tp2 ep2, path auto): "
                    f"bitwise the gradients without it", lambda r=reentrant: checkpoint_tp_case(r, "auto", "layer"))
        add("auto: masked for inference when ep == tp", lambda: layer_case(tp=2, ep=2, path="auto", train=False))
        add("auto: all_to_all for training", lambda: layer_case(tp=2, ep=2, path="auto"))
        add("auto: the path each call takes (masked without gradients, all_to_all with them)", auto_path_case)
        add("bitwise = epx::moe_layer (all_to_all, float32)", lambda: bitwise_case(dtype=f32))
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"bitwise = epx::moe_layer (all_to_all, {name})", lambda dt=dt: bitwise_case(dtype=dt))
        add("bitwise = epx::moe_layer (all_to_all, tp2, float64)", lambda: bitwise_case(tp=2, dtype=f64))
        add("bitwise = epx::moe_layer, inference (all_to_all, float32)", lambda: bitwise_case(dtype=f32, train=False))
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"bitwise = epx::moe_layer, inference (all_to_all, tp2, {name})",
                lambda dt=dt: bitwise_case(tp=2, dtype=dt, train=False))
        add("bitwise = epx::moe_layer, inference (transport group, float32)",
            lambda: bitwise_case(dtype=f32, transport="group", train=False))
        add("bitwise = epx::moe_layer (transport group, tp2, float32)",
            lambda: bitwise_case(tp=2, dtype=f32, transport="group"))
        for dt, name in ((f32, "float32"), (f16, "float16")):
            add(f"bitwise = epx::moe_layer (all_reduce, {name})",
                lambda dt=dt: bitwise_case(tp=2, ep=2, dtype=dt, path="all_reduce"))
    if W >= 4:
        add(f"all_to_all tp2 fsdp{W // 2} ep4 (efsdp {W // 4})", lambda: layer_case(tp=2, fsdp=W // 2, ep=4))
        add(f"all_to_all tp1 ep2 efsdp{W // 2}", lambda: layer_case(tp=1, fsdp=W, ep=2))
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"all_to_all tp1 ep2 efsdp{W // 2} {name}: expert gradients summed over efsdp",
                lambda dt=dt: layer_case(tp=1, fsdp=W, ep=2, dtype=dt))
        add(f"transport group: tp2 fsdp{W // 2} ep4", lambda: layer_case(tp=2, fsdp=W // 2, ep=4, transport="group"))
        add("all_to_all dp_replicate 2", lambda: layer_case(tp=1, fsdp=W // 2, ep=2, dp_replicate=2))
        add("all_reduce (masked) with dp_replicate 2",
            lambda: layer_case(tp=2, fsdp=W // 4, ep=2, dp_replicate=2, path="all_reduce"))
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"all_to_all tp1 ep1 efsdp{W // 2} dp_replicate 2 {name}: expert gradients summed over efsdp and "
                f"dp_replicate", lambda dt=dt: layer_case(tp=1, fsdp=W // 2, ep=1, dp_replicate=2, dtype=dt))
        add(f"all_to_all tp1 ep{W // 2} efsdp1 dp_replicate 2 bfloat16: expert gradients summed over dp_replicate",
            lambda: layer_case(tp=1, fsdp=W // 2, ep=W // 2, dp_replicate=2, dtype=bf16))
    if W >= 8:
        add("all_to_all tp2 fsdp4 ep4 (the seed's mesh) float32", lambda: layer_case(tp=2, fsdp=4, ep=4, dtype=f32))
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"all_to_all tp2 fsdp4 ep8 efsdp1 {name}", lambda dt=dt: layer_case(tp=2, fsdp=4, ep=8, dtype=dt))
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"all_to_all tp2 fsdp4 ep4 efsdp2 {name}: expert gradients summed over efsdp",
                lambda dt=dt: layer_case(tp=2, fsdp=4, ep=4, dtype=dt))
        add("bitwise = epx::moe_layer (tp2 ep4, float32)", lambda: bitwise_case(tp=2, ep=4, dtype=f32))
    add("every copy streamed (stream threshold 0), against the reference", streamed_case)
    out.extend(emulated_cases(W))
    out.extend(error_cases(W))
    # Last: it replaces the job's process groups.
    out.append(("process groups destroyed and made again: a new Layer makes new groups", reinit_case))
    return out


def emulated_cases(W: int):
    """The device path on the CPU (Layer(device="emulated"): the code of the CUDA layer with
    the emulated device policy over the device communicator): against the float64
    reference and bitwise against epx::moe_layer on the same policy and communicators
    (test_device.py compares it with the host layer bit for bit: run.py --device emulated)."""
    out = []
    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    add = lambda name, fn: out.append((f"emulated device: {name}", fn))  # noqa: E731
    for dt in (f64, f32, bf16, f16):
        add(f"all_to_all tp1 ep{W} {dt}", lambda dt=dt: layer_case(tp=1, dtype=dt, device="emulated"))
    add("all_to_all inference (no_grad)", lambda: layer_case(tp=1, train=False, device="emulated"))
    add("padding 2 rows, align 4", lambda: layer_case(padding=(2, 4), check_padding=True, device="emulated"))
    add("one expert takes every token", lambda: layer_case(routing="one_expert", device="emulated"))
    add("bitwise = epx::moe_layer (all_to_all, float32)", lambda: bitwise_case(dtype=f32, device="emulated"))
    for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
        add(f"bitwise = epx::moe_layer (all_to_all, {name})", lambda dt=dt: bitwise_case(dtype=dt, device="emulated"))
    if W >= 2:
        add("all_to_all tp2 float64", lambda: layer_case(tp=2, dtype=f64, device="emulated"))
        add("all_to_all tp2 one-token decode (empty slice)", lambda: layer_case(tp=2, N=1, device="emulated"))
        add("all_reduce (masked) ep == tp == 2", lambda: layer_case(tp=2, ep=2, path="all_reduce", device="emulated"))
        add("all_reduce (masked) float16",
            lambda: layer_case(tp=2, ep=2, path="all_reduce", dtype=f16, device="emulated"))
        add("experts that do not read the rows on a rank that received none", lambda: unused_rows_case("emulated"))
        add("expert hooks on a rank whose experts received no rows", lambda: unused_expert_hook_case("emulated"))
        add("experts that return a constant, no input requires grad", lambda: constant_experts_case("emulated"))
        add("activation checkpointing (use_reentrant=False, around the layer): expert hooks on a rank whose "
            "experts received no rows", lambda: checkpoint_hook_case(False, ep=W, device="emulated"))
        add("activation checkpointing (use_reentrant=True, around the experts): expert hooks on a rank whose "
            "experts received no rows", lambda: checkpoint_hook_case(True, scope="experts", device="emulated"))
        for reentrant in (True, False):
            add(f"activation checkpointing (use_reentrant={reentrant}, around dispatch and the experts): expert "
                f"hooks on a rank whose experts received no rows",
                lambda r=reentrant: checkpoint_hook_case(r, ep=W, scope="dispatch", device="emulated"))
            add(f"activation checkpointing (use_reentrant={reentrant}, around combine alone): refused on every rank",
                lambda r=reentrant: checkpoint_hook_case(r, ep=W, scope="combine", device="emulated"))
        add("bitwise = epx::moe_layer (all_to_all, tp2, float64)",
            lambda: bitwise_case(tp=2, dtype=f64, device="emulated"))
        add("bitwise = epx::moe_layer, inference (all_to_all, float32)",
            lambda: bitwise_case(dtype=f32, train=False, device="emulated"))
        for dt, name in ((f32, "float32"), (f16, "float16")):
            add(f"bitwise = epx::moe_layer (all_reduce, {name})",
                lambda dt=dt: bitwise_case(tp=2, ep=2, dtype=dt, path="all_reduce", device="emulated"))
    if W >= 4:
        add("all_to_all dp_replicate 2", lambda: layer_case(tp=1, fsdp=W // 2, ep=2, dp_replicate=2, device="emulated"))
        add(f"all_to_all tp2 fsdp{W // 2} ep4 (efsdp {W // 4})",
            lambda: layer_case(tp=2, fsdp=W // 2, ep=4, device="emulated"))
        add(f"all_to_all tp1 ep2 efsdp{W // 2} bfloat16: expert gradients summed over efsdp",
            lambda: layer_case(tp=1, fsdp=W, ep=2, dtype=bf16, device="emulated"))
        add(f"all_to_all tp1 ep1 efsdp{W // 2} dp_replicate 2 bfloat16: expert gradients summed over efsdp and "
            f"dp_replicate", lambda: layer_case(tp=1, fsdp=W // 2, ep=1, dp_replicate=2, dtype=bf16, device="emulated"))
    if W >= 8:
        for dt, name in ((bf16, "bfloat16"), (f16, "float16")):
            add(f"all_to_all tp2 fsdp4 ep8 {name}",
                lambda dt=dt: layer_case(tp=2, fsdp=4, ep=8, dtype=dt, device="emulated"))
    add("strict memory: the host never touches the device's memory; every wait bounded", strict_memory_case)
    add("host synchronisations: dispatch 1, combine 1, backward 0 (all_to_all)", lambda: host_syncs_case("all_to_all"))
    if W >= 2:
        add("host synchronisations: dispatch 1, combine 1, backward 0 (all_reduce)",
            lambda: host_syncs_case("all_reduce"))
    add("error: device='cuda' without the CUDA build", cuda_without_build)
    add("error: transport='shm' on a device layer", shm_on_device_layer)
    return out


def streamed_case():
    """With a stream threshold of 0 every host copy of epx and every copy of the
    shared-memory exchange writes around the caches (non-temporal stores, as an exchange of
    4 MiB or more does by default): the layers still match the float64 reference."""
    C = epx_torch._C
    prev = C._set_stream_threshold(0)
    try:
        layer_case(tp=1, dtype=torch.float32)
        layer_case(tp=1, dtype=torch.bfloat16)
        if dist.get_world_size() >= 4:
            layer_case(tp=2, dtype=torch.float64)
    finally:
        C._set_stream_threshold(prev)


def strict_memory_case():
    """Under strict memory the emulated device's buffers (the plan, the communicator's
    scratch) fault on any host access outside a launch scope, as device memory would on a
    GPU; the layer's calls must also make no host wait for a queued collective outside the
    communicator's bounded wait."""
    C = epx_torch._C
    waits = C._emulated_unbounded_waits()
    C._emulated_strict_memory(True)
    try:
        layer_case(tp=1, dtype=torch.float32, device="emulated")
        layer_case(tp=1, dtype=torch.bfloat16, train=False, device="emulated")
        if dist.get_world_size() >= 2:
            layer_case(tp=2, dtype=torch.float64, device="emulated")
            layer_case(tp=2, ep=2, path="all_reduce", device="emulated")
    finally:
        C._emulated_strict_memory(False)
    extra = C._emulated_unbounded_waits() - waits
    assert extra == 0, f"{extra} host wait(s) for a queued collective outside the communicator's bounded wait"


def host_syncs_case(path):
    """The device layer waits on the host once in dispatch (the count exchange's records) and
    once in combine (the check of the expert output), and never in backward."""
    W = dist.get_world_size()
    tp = 2 if path == "all_reduce" else 1
    mesh = epx_torch.Mesh(tp=tp, fsdp=W // tp, ep=tp if path == "all_reduce" else W, experts=E_DEFAULT)
    layer = epx_torch.Layer(mesh, hidden=H, top_k=3, path=path, device="emulated")
    x, ids, w, G = batch_data(layer.batch, 12, 3, E_DEFAULT, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    syncs = epx_torch._C._host_syncs
    s0 = syncs()
    rows, offsets, handle = epx_torch.dispatch(x, ids, w, layer)
    s1 = syncs()
    out = epx_torch.combine(rows * 2, handle)
    s2 = syncs()
    out.backward(G)
    s3 = syncs()
    got = (s1 - s0, s2 - s1, s3 - s2)
    assert got == (1, 1, 0), f"host synchronisations (dispatch, combine, backward) = {got}, expected (1, 1, 0)"


def cuda_without_build():
    if epx_torch._C.with_cuda:
        return  # the CUDA build is loaded: device='cuda' is available (test_cuda.py runs it)
    mesh = epx_torch.Mesh(ep=dist.get_world_size(), fsdp=dist.get_world_size(), experts=E_DEFAULT)
    expect_error(lambda: epx_torch.Layer(mesh, hidden=H, top_k=2, device="cuda"), "", "needs the CUDA build")


def shm_on_device_layer():
    mesh = epx_torch.Mesh(ep=dist.get_world_size(), fsdp=dist.get_world_size(), experts=E_DEFAULT)
    try:
        epx_torch.Layer(mesh, hidden=H, top_k=2, device="emulated", transport="shm")
    except ValueError as e:
        assert "transport='shm' is for device='cpu'" in str(e), str(e)
    else:
        raise AssertionError("transport='shm' on an emulated layer was accepted")
