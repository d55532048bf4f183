"""epx against transformers' own expert parallelism on a small Qwen3-MoE model.

8 gloo processes. A one-layer Qwen3-MoE model is built from a local config with seeded
random weights (no download) and saved to a temporary folder; every rank loads it with
transformers' DistributedConfig (tp_size=2, fsdp_size=4, ep_size=4 or 8,
ep_implementation="all_to_all": transformers' AllToAllEP under FSDP2), runs the model on its
batch and backpropagates a seeded loss. Hooks on the MoE block (model.layers[0].mlp) keep
its input, its output and the gradient that reaches its output.

Then the same block runs with epx doing the dispatch and the combine: the same router
module (transformers' Qwen3MoeTopKRouter), the same experts module (transformers'
Qwen3MoeExperts, holding this rank's local experts, called on epx's expert-major rows with
their local ids, as AllToAllEP calls it), on the block input transformers saw, and
backward from the gradient transformers' block output received. Compared, per rank:
outputs, the gradient with respect to the block input (router path included) and the
expert weight gradients (transformers: after FSDP2's reduction over efsdp, divided by its
gradient_divide_factor; epx: after its expert hook, the sum over efsdp divided by B).
"""

from __future__ import annotations

import copy
import os
import pathlib
import tempfile

import torch
import torch.distributed as dist

import epx_torch
from harness import check_close, rel_err, say

HIDDEN, MOE_INTER, EXPERTS, TOP_K, SEQ = 32, 16, 8, 2, 12
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

_saved_dir: str | None = None


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=MOE_INTER,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False,
                          initializer_range=0.2, tie_word_embeddings=False, max_position_embeddings=64,
                          attn_implementation="eager")


def _model_dir() -> str:
    """Rank 0 writes the seeded model once; every rank gets the folder's name."""
    global _saved_dir
    if _saved_dir is None:
        name = [None]
        if dist.get_rank() == 0:
            from transformers import Qwen3MoeModel

            torch.manual_seed(1234)
            model = Qwen3MoeModel(_config())
            d = tempfile.mkdtemp(prefix="epx-qwen3moe-")
            model.save_pretrained(d)
            name[0] = d
        dist.broadcast_object_list(name, src=0)
        _saved_dir = name[0]
    return _saved_dir


def _experts_implementation(dtype) -> str:
    # transformers' default, grouped_mm (torch._grouped_mm), has no float64 kernel.
    return "eager" if dtype == torch.float64 else "grouped_mm"


def _quiet():
    import logging
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="torch.distributed")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _batch(b: int, dtype):
    g = torch.Generator().manual_seed(500 + b)
    x = torch.randn(1, SEQ, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    G = torch.randn(1, SEQ, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    return x, G


def run_transformers(dtype, tp: int, fsdp: int, ep: int):
    """transformers' EP: the block's input, output, output gradient, input gradient and
    this EP rank's expert gradients."""
    from transformers import Qwen3MoeModel
    from transformers.distributed import DistributedConfig

    dc = DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep, ep_implementation="all_to_all")
    model = Qwen3MoeModel.from_pretrained(_model_dir(), distributed_config=dc, dtype=dtype,
                                          experts_implementation=_experts_implementation(dtype))
    model.train()
    block = model.layers[0].mlp
    seen = {}

    def keep(module, args, output):
        inp = args[0]
        seen["x"] = inp.detach().clone()
        inp.register_hook(lambda g: seen.__setitem__("grad_x", g.detach().clone()))
        output.register_hook(lambda g: seen.__setitem__("grad_out", g.detach().clone()))
        seen["out"] = output.detach().clone()

    block.register_forward_hook(keep)
    rank = dist.get_rank()
    b = rank // tp  # the batch of this rank: (fsdp_i) with tp fastest
    x, G = _batch(b, dtype)
    h = model(inputs_embeds=x).last_hidden_state
    (h * G).sum().backward()
    grads = {}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(block.experts, name)
        g = p.grad
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        grads[name] = full.detach().clone()
    return seen, grads


def run_epx(dtype, tp: int, fsdp: int, ep: int, seen):
    """The same block with epx's dispatch and combine."""
    from transformers import Qwen3MoeModel

    plain = Qwen3MoeModel.from_pretrained(_model_dir(), dtype=dtype,
                                          experts_implementation=_experts_implementation(dtype))
    block = plain.layers[0].mlp
    mesh = epx_torch.Mesh(tp=tp, fsdp=fsdp, ep=ep, experts=EXPERTS)
    layer = epx_torch.Layer(mesh, hidden=HIDDEN, top_k=TOP_K, dtype=dtype)
    L, first = layer.local_experts, layer.first_expert
    experts = copy.deepcopy(block.experts)
    experts.gate_up_proj = torch.nn.Parameter(block.experts.gate_up_proj.detach()[first:first + L].clone())
    experts.down_proj = torch.nn.Parameter(block.experts.down_proj.detach()[first:first + L].clone())
    experts.num_experts = L
    experts._is_expert_parallel = True
    layer.register_expert_hooks(experts.parameters())
    gate = block.gate

    x = seen["x"].clone().requires_grad_()
    flat = x.view(-1, HIDDEN)
    _, weights, ids = gate(flat)
    rows, offsets, handle = epx_torch.dispatch(flat, ids, weights, layer)
    lid = handle.local_expert_ids().unsqueeze(-1)
    y = experts(rows, lid, torch.ones(lid.shape, dtype=rows.dtype))
    out = epx_torch.combine(y, handle).view_as(x)
    out.backward(seen["grad_out"])
    return out.detach(), x.grad, {n: getattr(experts, n).grad for n in ("gate_up_proj", "down_proj")}, layer


def compare(dtype, tp, fsdp, ep, expert_tol=None):
    seen, tf_grads = run_transformers(dtype, tp, fsdp, ep)
    out, grad_x, grads, layer = run_epx(dtype, tp, fsdp, ep, seen)
    tol = TOL[dtype]
    errs = {"output": check_close("output", out, seen["out"], tol),
            "input gradient": check_close("input gradient", grad_x, seen["grad_x"], tol)}
    L, first = layer.local_experts, layer.first_expert
    for n, g in grads.items():
        want = tf_grads[n][first:first + L]
        if expert_tol is None:
            errs[n] = check_close(f"expert gradient {n}", g, want, tol)
        else:
            # transformers' gradients are the sum over all batches / B^2 here: B times epx's.
            B = layer.mesh.batches
            errs[n + " x B"] = check_close(f"expert gradient {n} times B", want * B, g, tol)
            errs[n] = rel_err(g, want)
    return errs


def _report(label, errs):
    worst = {k: 0.0 for k in errs}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errs)
    for e in gathered:
        for k, v in e.items():
            worst[k] = max(worst[k], v)
    say(f"  transformers vs epx, {label}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    return worst


def cases(W: int):
    if W != 8:
        return []
    _quiet()

    def f32_ep4():
        _report("float32 tp2 fsdp4 ep4 (efsdp 2)", compare(torch.float32, 2, 4, 4))

    def f64_ep4():
        _report("float64 tp2 fsdp4 ep4 (efsdp 2)", compare(torch.float64, 2, 4, 4))

    def f32_ep8():
        _report("float32 tp2 fsdp4 ep8 (efsdp 1)", compare(torch.float32, 2, 4, 8))

    def f64_ep8():
        # transformers' FSDP2 divides the expert gradients twice here (sum / B^2, B = 4):
        # outputs and input gradients are compared to 1e-12, the expert gradients are compared
        # after multiplying transformers' by B (and, unscaled, in float32 above).
        errs = compare(torch.float64, 2, 4, 8, expert_tol="times B")
        _report("float64 tp2 fsdp4 ep8 (efsdp 1), transformers' expert gradients times B", errs)

    return [("transformers AllToAllEP vs epx: float32, tp2 fsdp4 ep4", f32_ep4),
            ("transformers AllToAllEP vs epx: float64, tp2 fsdp4 ep4", f64_ep4),
            ("transformers AllToAllEP vs epx: float32, tp2 fsdp4 ep8 (efsdp 1)", f32_ep8),
            ("transformers AllToAllEP vs epx: float64, tp2 fsdp4 ep8 (efsdp 1; transformers divides expert gradients by B twice)", f64_ep8)]
