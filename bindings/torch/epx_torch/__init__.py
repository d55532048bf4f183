"""epx for PyTorch: expert-parallel dispatch and combine as differentiable ops over a
torch.distributed process group.

    import epx_torch
    layer = epx_torch.Layer(epx_torch.Mesh(tp=2, fsdp=4, ep=4, experts=8), hidden=H, top_k=k)
    rows, offsets, handle = epx_torch.dispatch(x, ids, weights, layer)   # expert-major rows
    y = my_experts(rows, offsets)                                        # any torch code
    out = epx_torch.combine(y, handle)                                   # [N, H]
    out.sum().backward()                     # through combine, the experts and dispatch
    layer.register_expert_hooks(my_experts.parameters())                 # 1/B mean (contract 6)

On GPUs, `Layer(..., device="cuda")` keeps every tensor on the current CUDA device and runs
epx's kernels on torch's current stream, with the collectives of the group's NCCL backend
(the CUDA build of the extension, made where torch sees a GPU or with EPX_TORCH_CUDA=1).

`rows` holds local expert l's rows at offsets[l]:offsets[l+1] (from every EP rank, in
rank order, then the zero padding rows); global expert id = layer.first_expert + l.
Gradients flow to x (input rows) and to the routing weights (through combine). Bad input on
any rank raises EpxError with epx's message on every rank of the EP group. docs/pytorch.md
has a complete layer.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from . import _build

_C = _build.load()

EpxError = _C.EpxError
Mesh = _C.Mesh

__all__ = ["EpxError", "Mesh", "Layer", "Handle", "dispatch", "combine", "local_expert_ids"]

_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_PATHS = {"all_to_all": 0, "all_reduce": 1, "auto": 2}
_TRANSPORTS = {"auto": 0, "shm": 1, "group": 2}

# The name of this rank's group of each split, by the split's members (every rank of the job
# makes every group once),
# for the job's default group `_GROUPS_WORLD` (a weak reference): a job that destroys its
# process groups and initialises new ones (whose names start again at "0") gets new groups.
# Only the groups' names are kept: torch holds the groups until destroy_process_group, and a
# group that outlived it here would be destroyed at interpreter exit, where gloo's threads
# abort the process ("terminate called without an active exception").
_GROUPS: dict[tuple, str] = {}
_GROUPS_WORLD = None


def _timeout(group, device: str = "cpu") -> timedelta:
    """The timeout of a process group's backend for `device` (its collectives fail after
    it), else 30 min."""
    try:
        return group._get_backend(torch.device(device)).options._timeout
    except Exception:  # noqa: BLE001 - other backends keep their options elsewhere
        return timedelta(minutes=30)


def _layer_class(device: str):
    """The extension's layer for a device: "cpu" (epx's host path), "cuda" (the CUDA build)
    or "emulated" (the device path on the CPU, with CPU tensors: for tests)."""
    if device == "cpu":
        return _C._Layer
    if device == "emulated":
        return _C._EmulatedLayer
    if device == "cuda":
        if not _C.with_cuda:
            raise EpxError("epx_torch: Layer(device='cuda') needs the CUDA build of the extension, which is made "
                           "where torch sees a GPU or with EPX_TORCH_CUDA=1 (this process loaded the CPU build)")
        return _C._CudaLayer
    raise ValueError(f"device must be 'cpu', 'cuda' or 'emulated', not {device!r}")


def _integer(name: str, v) -> int:
    """v as an int: an int (or anything with __index__, a 0-d integer tensor among them);
    ValueError for anything else (4.5, "4"), which int() would truncate or parse."""
    import operator

    if isinstance(v, bool):
        raise ValueError(f"{name} must be an int, not {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be an int, not {v!r}") from None


def _make_groups(groups: Sequence[Sequence[int]], mine: int) -> str:
    global _GROUPS_WORLD
    if _GROUPS_WORLD is None or _GROUPS_WORLD() is not dist.group.WORLD:  # a new default group
        _GROUPS.clear()
        _GROUPS_WORLD = weakref.ref(dist.group.WORLD)
    key = tuple(tuple(g) for g in groups)
    if key not in _GROUPS:
        world = list(range(dist.get_world_size()))
        timeout = _timeout(dist.group.WORLD)  # sub-groups fail as soon as the job's group would
        made = [dist.group.WORLD if list(g) == world else dist.new_group(ranks=list(g), timeout=timeout)
                for g in groups]  # every rank makes every group; another's is a placeholder here
        _GROUPS[key] = made[mine].group_name
    return _GROUPS[key]


_C.set_split_callback(_make_groups)


class Layer:
    """The expert-parallel configuration of one MoE layer over a torch process group.

    Collective over `group` (default: the whole job): checks that every rank built the same
    mesh and options (EpxError on every rank otherwise, naming the ranks and values) and
    makes the ep, tp, efsdp, fsdp and dp_replicate groups of the mesh (once per job; later
    layers reuse them).

    mesh      epx_torch.Mesh(tp=, fsdp=, ep=, pp=, dp_replicate=, experts=); its world must
              be the group's size
    hidden    H, the row length
    top_k     k, slots per token
    dtype     element type of x and of the expert rows (float32, float64, bfloat16, float16)
    padding   (rows_per_expert, align): zero rows appended to each local expert's segment;
              (0, 1) turns padding off
    path      "all_to_all" (token dispatch), "all_reduce" (the masked path, ep == tp), or
              "auto" (all_reduce for calls without gradients when ep == tp, else all_to_all)
    transport how dispatch and combine move rows inside the EP group: "auto" (shared memory
              when all its ranks run on one host, else the process group's all_to_all),
              "shm" (shared memory, an error on every rank where impossible) or "group"
              (always the process group's all_to_all); on "cuda" and "emulated" always
              the process group's
    device    "cpu" (CPU tensors, gloo), "cuda" (CUDA tensors of the current device, NCCL;
              the kernels run on torch's current stream) or "emulated" (CPU tensors over
              gloo through the device path, for tests)
    """

    def __init__(self, mesh: Mesh, hidden: int, top_k: int, *, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None, padding: tuple[int, int] = (1, 1),
                 path: str = "all_to_all", transport: str = "auto", device: str | torch.device = "cpu"):
        group = group if group is not None else dist.group.WORLD
        job = dist.get_world_size()
        if dist.get_world_size(group) != job:
            # The mesh's groups are made over the job's ranks (its pp and dp_replicate
            # dimensions cover what lies outside one pipeline stage or replica).
            raise EpxError(f"epx_torch.Layer: the group must hold every rank of the job ({job}); this one holds "
                           f"{dist.get_world_size(group)} (a mesh with pp or dp_replicate covers the rest of the job)")
        # The arguments are checked on each rank, then every rank's verdict and device are
        # gathered before anything else: a rank whose arguments are wrong raises ValueError,
        # and the others raise EpxError naming it, instead of waiting for it in the layer's
        # collectives until the group's timeout.
        problem = None
        try:
            if not isinstance(mesh, Mesh):
                raise TypeError(f"mesh must be an epx_torch.Mesh, not {type(mesh).__name__}")
            if dtype not in _DTYPES:
                raise ValueError(f"dtype must be one of {list(_DTYPES)}, not {dtype}")
            if path not in _PATHS:
                raise ValueError(f"path must be one of {list(_PATHS)}, not {path!r}")
            if transport not in _TRANSPORTS:
                raise ValueError(f"transport must be one of {list(_TRANSPORTS)}, not {transport!r}")
            device = torch.device(device).type if isinstance(device, torch.device) else str(device)
            if device not in ("cpu", "cuda", "emulated"):
                raise ValueError(f"device must be 'cpu', 'cuda' or 'emulated', not {device!r}")
            if device != "cpu" and transport == "shm":
                raise ValueError(f"transport='shm' is for device='cpu'; a {device} layer moves rows through the group")
            hidden, top_k = _integer("hidden", hidden), _integer("top_k", top_k)
            if len(padding) != 2:
                raise ValueError(f"padding must be (rows_per_expert, align), not {padding!r}")
            padding = (_integer("padding[0]", padding[0]), _integer("padding[1]", padding[1]))
            cls = _layer_class(device)
        except (ValueError, TypeError, EpxError) as e:
            problem = e
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        verdicts: list = [None] * size
        dist.all_gather_object(verdicts, (None if problem is None else f"{type(problem).__name__}: {problem}",
                                          None if problem is not None else device), group=group)
        if problem is not None:
            raise problem
        bad = [f"rank {r}: {v[0]}" for r, v in enumerate(verdicts) if v[0] is not None]
        if bad:
            raise EpxError("epx_torch.Layer: the arguments of other ranks of the group are wrong; " + "; ".join(bad))
        self.group = group
        self.device = device
        self.dtype = dtype
        self.path = path
        self.transport = transport
        self.hidden = hidden
        self.top_k = top_k
        self.padding = padding
        timeout = _timeout(group, "cuda" if device == "cuda" else "cpu").total_seconds()
        # A layer's collectives go through the host communicator or the device one, by
        # device: ranks that passed different devices would wait on each other until the
        # group's timeout in the layer's own agreement. Compared first, so that they raise.
        devices = [v[1] for v in verdicts]
        differ = [f"rank {r} has device={d!r} but rank 0 has device={devices[0]!r}"
                  for r, d in enumerate(devices) if d != devices[0]]
        if differ:
            raise EpxError("epx_torch.Layer: the ranks of the group passed different devices (every rank must pass "
                           "the same); " + "; ".join(differ))
        self._impl = cls(mesh, group.group_name, rank, size, self.hidden, self.top_k, self.padding[0],
                         self.padding[1], _DTYPES[dtype], _PATHS[path], _TRANSPORTS[transport], timeout)
        self.mesh = mesh
        self.rank = rank
        # The hooked parameters, in registration order (the same on every rank), and where
        # the layer comes among the job's layers (their hooked gradients are reduced in it).
        self._hooked: dict = {"expert": [], "dense": []}
        self._order = next(_LAYER_ORDER)

    @property
    def shared_memory(self) -> bool:
        """Whether dispatch and combine move rows through shared memory (transport)."""
        return self._impl.shared_memory

    # A layer is made collectively and holds the job's groups and its hooked parameters:
    # neither a copy nor a pickle of it could be one. Both raise, saying what to do instead.
    def __deepcopy__(self, memo):
        raise TypeError("epx_torch.Layer cannot be deep-copied: it is made by every rank together and holds the "
                        "job's process groups and its hooked parameters. To copy a module that holds one (an EMA "
                        "copy, say), share the layer: copy.deepcopy(model, {id(layer): layer}) (the copy's "
                        "parameters are not hooked: reduce their gradients yourself if the copy trains); to save "
                        "a model, save its state_dict()")

    def __reduce_ex__(self, protocol):
        raise TypeError("epx_torch.Layer cannot be pickled (torch.save of a whole module that holds one, "
                        "copy.copy): it is made by every rank together and holds the job's process groups. Save "
                        "the module's state_dict() (the layer has no parameters or buffers) and make the Layer "
                        "again where the model is loaded")

    # Where this rank sits in the mesh.
    @property
    def local_experts(self) -> int:
        return self.mesh.local_experts

    @property
    def first_expert(self) -> int:
        """Global id of this rank's local expert 0."""
        return self.mesh.expert_begin(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.mesh.ep_rank(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.mesh.tp_rank(self.rank)

    @property
    def batch(self) -> int:
        """The batch this rank holds, in [0, mesh.batches)."""
        return self.mesh.batch(self.rank)

    def uses_masked_path(self, training: bool | None = None) -> bool:
        """Whether a call takes the masked path: path "all_reduce", or "auto" with ep == tp
        for a call without gradients (`training`: whether the call keeps what backward needs;
        by default whether gradients are enabled)."""
        if self.path == "all_reduce":
            return True
        training = torch.is_grad_enabled() if training is None else training
        return self.path == "auto" and self.mesh.ep == self.mesh.tp and not training

    # The contract's gradient semantics (section 6).
    def reduce_expert_gradients(self, grad: torch.Tensor) -> torch.Tensor:
        """In place: the sum over efsdp and dp_replicate divided by B (the mean over all
        batches) of an expert weight's gradient. Collective over the efsdp and dp_replicate
        groups."""
        return _in_place(self._impl.reduce_expert_gradients, grad)

    def reduce_dense_gradients(self, grad: torch.Tensor) -> torch.Tensor:
        """In place: the mean over the B batches of a dense (router, attention) gradient.
        Collective over the fsdp and dp_replicate groups."""
        return _in_place(self._impl.reduce_dense_gradients, grad)

    def register_expert_hooks(self, params: Iterable[torch.nn.Parameter] | torch.nn.Parameter) -> list:
        """Reduces each parameter's gradient with reduce_expert_gradients at the end of every
        backward that runs this layer's combine or accumulates a gradient into one of them,
        on every rank: a parameter that got no gradient on a rank in that backward (its
        experts received no rows and were skipped) gets a zero gradient there, reduced with
        the others', so that no rank waits for it. One reduction per backward: with gradient
        accumulation over several backward passes, call reduce_expert_gradients yourself
        instead. Under activation checkpointing, reentrant or not, around the layer, its
        experts, or dispatch with or without the experts, the gradients are those without it
        (docs/pytorch.md; around combine alone it raises): a backward nested in another
        leaves its reductions to the enclosing one where that one has some queued.
        Takes the parameters (or one): leaf tensors that require grad, each hooked at most
        once on the layer, by either kind (ValueError otherwise: hooked twice, a gradient
        would be reduced twice). Returns one handle per parameter; handle.remove() undoes it."""
        return self._register("expert", params)

    def register_dense_hooks(self, params: Iterable[torch.nn.Parameter] | torch.nn.Parameter) -> list:
        """As register_expert_hooks, with reduce_dense_gradients."""
        return self._register("dense", params)

    def _register(self, kind: str, params) -> list:
        def hook(p):
            _queue_reductions(self, kind)

        # One tensor stands for itself (iterating it would give its rows), as in
        # torch.nn.utils.clip_grad_norm_.
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        hooked = {id(e[0]): k for k in ("expert", "dense") for e in self._hooked[k]}
        seen = set()
        for i, p in enumerate(params):
            what = f"register_{kind}_hooks: parameter {i}"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{what} is a {type(p).__name__}, not a tensor")
            if not (p.is_leaf and p.requires_grad):
                raise ValueError(f"{what} must be a leaf tensor that requires grad (a torch.nn.Parameter): "
                                 "its gradient is reduced where autograd accumulates it")
            if id(p) in hooked or id(p) in seen:
                again = hooked.get(id(p), kind)
                raise ValueError(f"{what} is already hooked on this layer (register_{again}_hooks): its gradient "
                                 "would be reduced twice in every backward")
            seen.add(id(p))
        handles = []
        for p in params:
            entry = [p]
            self._hooked[kind].append(entry)
            handles.append(_HookHandle(p.register_post_accumulate_grad_hook(hook), self._hooked[kind], entry))
        return handles

    def _reduce_hooked(self, fired: set) -> None:
        """At the end of a backward (_queue_reductions), on every rank: for each kind of hooked
        parameters, the ranks that reduce together first agree whether any of them got a
        gradient in this backward (a one-element reduction); if one did, every parameter's
        gradient is reduced in registration order, a zero one where it got none."""
        for kind, reduce in (("expert", self.reduce_expert_gradients), ("dense", self.reduce_dense_gradients)):
            entries = list(self._hooked[kind])
            if not entries:
                continue
            device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
            flag = torch.full((1,), 1.0 if kind in fired else 0.0, device=device)
            reduce(flag)
            if flag.item() == 0:
                continue  # no rank got a gradient (torch.autograd.grad, or parameters unused everywhere)
            for (p,) in entries:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                reduce(p.grad)


class _HookHandle:
    """What register_expert_hooks and register_dense_hooks return per parameter."""

    def __init__(self, handle, entries: list, entry: list):
        self._handle, self._entries, self._entry = handle, entries, entry

    def remove(self) -> None:
        self._handle.remove()
        if any(e is self._entry for e in self._entries):
            self._entries[:] = [e for e in self._entries if e is not self._entry]


# Per backward (autograd's graph task, by its id): a weak reference to the callback queued
# on it (alive while the graph task is: a backward that raised drops its callbacks, and its
# entry is then pruned) and the layers whose hooked gradients it reduces at its end, by
# creation order, each with the kinds of its hooked parameters that got a gradient there.
_PENDING: dict = {}
_LAYER_ORDER = itertools.count()


class _Reductions:
    """The callback queued on a graph task: runs _run_reductions for it."""

    def __init__(self, task: int):
        self.task = task

    def __call__(self) -> None:
        _run_reductions(self.task)


def _queue_reductions(layer: Layer, kind: str | None = None) -> None:
    """Called during backward (from a hook, with the parameter's kind, or from combine's
    backward, which runs on every rank of the layer's groups): queues, once per backward, a
    callback on autograd's engine that reduces the hooked gradients of every layer touched,
    in the order the layers were made (the same on every rank)."""
    if not (layer._hooked["expert"] or layer._hooked["dense"]):
        return
    task = torch._C._current_graph_task_id()
    entry = _PENDING.get(task)
    if entry is None:
        for old in [t for t, (alive, _) in _PENDING.items() if alive() is None]:
            del _PENDING[old]  # a backward that raised before its end
        callback = _Reductions(task)
        entry = _PENDING[task] = (weakref.ref(callback), {})
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    fired = entry[1].setdefault(layer._order, (layer, set()))[1]
    if kind is not None:
        fired.add(kind)


def _run_reductions(task: int) -> None:
    _, mine = _PENDING.pop(task, (None, {}))
    # A backward nested in a running one that has reductions queued too (graph task ids grow:
    # an older one still alive encloses this one) leaves its reductions to it. This is
    # reentrant activation checkpointing (use_reentrant=True) around the experts (or around
    # dispatch with or without the experts, whose hooks fire in the recomputation): there the
    # enclosing backward runs combine's backward, on every rank, before the nested one, while
    # the nested one reaches the hooks only on the ranks whose experts received rows; reducing
    # at its end, those ranks would wait for the others in another collective. Around the
    # whole layer (dispatch, experts and combine), combine's backward is in the nested backward
    # on every rank: it reduces at its own end everywhere, unless an enclosing one has
    # reductions queued (on every rank too: a combine or a dense parameter's hook before it).
    enclosing = [t for t, (alive, _) in _PENDING.items() if t < task and alive() is not None]
    if enclosing:
        outer = _PENDING[max(enclosing)][1]
        for order, (layer, fired) in mine.items():
            outer.setdefault(order, (layer, set()))[1].update(fired)
        return
    for order in sorted(mine):
        layer, fired = mine[order]
        layer._reduce_hooked(fired)


def _in_place(reduce, grad: torch.Tensor) -> torch.Tensor:
    """reduce(grad) in place; a gradient that is not contiguous (a channels_last or
    transposed parameter's) is reduced in a contiguous copy, copied back. None (or another
    object) joins the reduction's agreement as a refusal: every rank of its groups raises."""
    if not isinstance(grad, torch.Tensor):
        reduce(None)
        raise EpxError("epx_torch: the gradient to reduce is None or not a tensor")  # reduce(None) raised already
    if grad.is_contiguous() or (grad.is_leaf and grad.requires_grad):
        reduce(grad)  # a leaf that requires grad goes as it is: the reduction refuses it on every rank
    else:
        dense = grad.contiguous()
        reduce(dense)
        grad.copy_(dense)
    return grad


class Handle:
    """What dispatch returns for combine: the layout of the call, the routing weights and,
    when they carry a graph, the expert-major rows (an input of combine's autograd node, so
    that dispatch's backward runs whenever combine's does: see combine; None otherwise)."""

    def __init__(self, layer: Layer, state, weights: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None):
        self.layer = layer
        self.state = state
        self.weights = weights
        self.offsets = offsets
        self.rows = rows

    @property
    def masked(self) -> bool:
        return self.state.masked

    def local_expert_ids(self) -> torch.Tensor:
        """The local expert id of every expert-major row ([R], int64; padding rows included)."""
        return local_expert_ids(self.offsets)


def local_expert_ids(offsets: torch.Tensor) -> torch.Tensor:
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.long, device=offsets.device), counts)


def _first_order(backward):
    """The backward halves run epx's collectives outside autograd, from state the forward
    kept (the routing weights, the experts' output): their results carry no graph. Under
    create_graph=True they are marked so that differentiating them again raises, instead of
    a second derivative that silently leaves epx's part out. As torch's once_differentiable,
    but the error's node also hangs on what the backward depends on (the incoming gradients
    and `ctx.anchors`, zero-element copies of the forward's differentiable inputs), so that
    torch.autograd.grad with respect to those inputs reaches it too."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        anchors = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
        anchors += list(getattr(ctx, "anchors", ()))
        err = torch._C._functions.DelayedError(
            b"epx_torch: dispatch and combine are differentiable once: a gradient computed through them with "
            b"create_graph=True cannot be differentiated again (double backward is not supported)",
            len(outputs) + len(anchors))

        def marked(t):
            if t is None:
                return t
            t = t.detach()
            t.requires_grad = True
            return t

        return tuple(err(*[marked(t) for t in outputs], *anchors)[:len(outputs)])

    return wrapper


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, weights, impl, masked, training, box):
        rows, offsets, state = impl.dispatch(x.detach(), ids, weights, training, masked)
        box.append(state)
        ctx.impl, ctx.state = impl, state
        ctx.mark_non_differentiable(offsets)
        # A zero-element tensor saved on every rank, as combine's `link`: under non-reentrant
        # activation checkpointing (use_reentrant=False) around dispatch and the experts
        # without combine, unpacking it at the start of dispatch's backward makes every rank
        # recompute the checkpointed forward (and run its dispatch, a collective) before
        # dispatch's backward: a rank whose experts saved tensors recomputes at its experts'
        # backward, one whose experts were skipped (and saved nothing) here, and both then
        # meet in the same collectives, in the same order.
        if training:
            ctx.save_for_backward(torch.empty(0))
        return rows, offsets

    @staticmethod
    @_first_order
    def backward(ctx, grad_rows, _grad_offsets):
        _ = ctx.saved_tensors  # recomputes a checkpointed forward here at the latest (see forward)
        grad_x = ctx.impl.dispatch_backward(ctx.state, grad_rows.contiguous())
        return grad_x, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    # `rows` (dispatch's output) is an input only for autograd's graph: its gradient here is
    # None, and dispatch's backward, a collective, then runs on every rank whose combine
    # backward runs, also where the experts' output does not depend on the rows (a rank whose
    # experts received no rows and return a constant). `link`, a zero-element tensor that
    # requires grad, is given on a call with gradients enabled, so that the output requires
    # grad on every rank (also where neither the experts' output nor the weights do there).
    @staticmethod
    def forward(ctx, expert_out, weights, rows, link, layer, state, anchors):
        impl = layer._impl
        ctx.impl, ctx.layer, ctx.state, ctx.anchors = impl, layer, state, anchors
        # The masked path's backward reads expert_out itself (the all-to-all path keeps a
        # copy): saved, so that an in-place change after combine raises torch's error. `link`
        # is saved on every rank (zero elements): under non-reentrant activation checkpointing
        # (torch.utils.checkpoint, use_reentrant=False) around dispatch and combine, unpacking
        # it in backward is what makes each rank recompute the checkpointed forward, and so
        # every rank recomputes it (and runs its dispatch and combine, collectives) at the same
        # point, at the start of combine's backward, through combine's forward; without it a
        # rank whose experts received no rows, and saved nothing, recomputed nothing while
        # another recomputed at its experts' backward, each waiting in another collective.
        saved = ([expert_out] if state.masked else []) + ([link] if link is not None else [])
        if saved:
            ctx.save_for_backward(*saved)
        # What backward needs is kept where a backward can follow (`link`: gradients enabled
        # on a training dispatch's handle); a training dispatch's handle combined under
        # torch.no_grad (a reentrant checkpoint's forward, where x requires grad) combines as
        # for inference.
        return impl.combine(state, expert_out.detach(), weights.detach(), link is not None)

    @staticmethod
    @_first_order
    def backward(ctx, grad_out):
        _ = ctx.saved_tensors  # torch's check that a saved expert_out was not modified in place
        # Runs on every rank of the layer's groups: the hooked gradients are reduced at the
        # end of this backward on all of them (also where the experts got no gradient).
        _queue_reductions(ctx.layer)
        grad_rows, grad_w = ctx.impl.combine_backward(ctx.state, grad_out.contiguous())
        return grad_rows, grad_w, None, None, None, None, None


def _ids32(ids: torch.Tensor) -> torch.Tensor:
    if isinstance(ids, torch.Tensor) and ids.dtype in (torch.int64, torch.int16, torch.int8, torch.uint8):
        # Values outside int32 become its limits, still outside [0, E): epx names them.
        return ids.clamp(-2**31, 2**31 - 1).to(torch.int32)
    return ids


def _weights32(weights: torch.Tensor) -> torch.Tensor:
    if isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.dtype != torch.float32:
        return weights.float()  # differentiable: the gradient returns in the caller's dtype
    return weights


def _not_tensors(**args) -> str:
    """Why an argument is not a tensor ("" when all are): a rank's verdict that the group's check
    of dispatch or combine carries to every rank, instead of a TypeError on this rank alone while
    the others go on and meet its next call."""
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} is None" if t is None else f"{name} is a {type(t).__name__}, not a tensor"
    return ""


def dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: Layer):
    """Sends each (token, slot) pair's row to the owner of its expert.

    x [N, H] (layer.dtype, on the layer's device), ids [N, k] global expert ids (int64 or
    int32; int16, int8 and uint8 too), weights [N, k] routing weights (float32; other float
    dtypes are converted). Collective over the layer's EP group (and its TP group). Returns
    (rows [R, H] expert-major, offsets [L+1] int64, handle). Differentiable with respect to
    x; the weights' gradient comes from combine.
    """
    # The call keeps what backward needs where gradients are enabled, and also under
    # torch.no_grad where x or the weights require grad: that is the forward of a reentrant
    # activation checkpoint (use_reentrant=True), whose segment may hold dispatch and the
    # experts without combine; combine, outside it, then runs with gradients on this handle,
    # and its backward on this call's state, while the segment's recomputation dispatches
    # again for the experts' and dispatch's backward. The weights' conversion to float32 is
    # recorded for the same reason: combine's routing-weight gradient reaches the caller's.
    if not isinstance(layer, Layer):
        raise TypeError(f"epx_torch dispatch: layer must be an epx_torch.Layer, not {type(layer).__name__}")
    grads = not torch.is_inference_mode_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weights))
    training = torch.is_grad_enabled() or grads
    masked = layer.uses_masked_path(training)
    why = _not_tensors(x=x, **{"expert ids": ids, "routing weights": weights})
    if why:  # raises EpxError on every rank of the group
        layer._impl.dispatch(*(t if isinstance(t, torch.Tensor) else None for t in (x, ids, weights)),
                             training, masked, why)
        raise EpxError(f"epx_torch dispatch: {why}")
    with torch.set_grad_enabled(training):
        w = _weights32(weights)
    box: list = []
    rows, offsets = _Dispatch.apply(x, _ids32(ids), w.detach() if isinstance(w, torch.Tensor) else w,
                                    layer._impl, masked, training, box)
    # The rows only when they carry a graph: an inference handle holds no reference to them.
    return rows, offsets, Handle(layer, box[0], w, offsets, rows if rows.requires_grad else None)


def combine(expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Brings the experts' output rows ([R, H], the rows dispatch returned, padding rows
    included; their values are discarded) back to their tokens and returns
    out[t] = sum_j w[t, j] * y[t, j] ([N, H]; every rank of a TP group gets the full
    output). Collective over the EP (and TP) group; once per dispatch. Differentiable with
    respect to expert_out and the routing weights given to dispatch, once per dispatch
    (retain_graph=True for a second backward through combine is not supported), and
    differentiable once (a gradient taken with create_graph=True cannot be differentiated
    again: doing so raises). Dispatch's backward runs wherever combine's does, also on a
    rank whose experts' output does not depend on the rows."""
    if not isinstance(handle, Handle):
        raise TypeError("epx_torch combine: handle must be the Handle that dispatch returned (the third of rows, "
                        f"offsets, handle), not {type(handle).__name__}")
    if why := _not_tensors(**{"expert output": expert_out}):  # raises EpxError on every rank of the group
        handle.layer._impl.combine(handle.state, None, handle.weights.detach(), False, why)
        raise EpxError(f"epx_torch combine: {why}")
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (expert_out, handle.weights))
    if needs_grad and not handle.state.training:
        raise EpxError("epx_torch combine: gradients are enabled here, but the dispatch of this handle ran "
                       "without them (under torch.inference_mode, or under torch.no_grad with neither x nor the "
                       "weights requiring grad): run dispatch and combine under the same grad mode")
    # Zero-element copies of the differentiable inputs (no memory held): where a double
    # backward must raise (_first_order).
    anchors = [t[:0].clone() for t in (expert_out, handle.weights) if isinstance(t, torch.Tensor) and t.requires_grad] \
        if needs_grad else []
    # With gradients enabled (the dispatch ran with them on every rank, which the layer
    # checks), the output requires grad on every rank, whatever this rank's inputs need: a
    # backward then runs combine's backward, a collective, on every rank, instead of raising
    # on the ranks whose output is a constant while the others wait for them.
    link = torch.empty(0, requires_grad=True) if torch.is_grad_enabled() and handle.state.training else None
    return _Combine.apply(expert_out, handle.weights, handle.rows, link, handle.layer, handle.state, anchors)
