"""The test harness of epx_torch: cases run on every rank of a torchrun job over gloo.

Each case is a function of no arguments that raises on failure. run() runs it on every
rank, gathers every rank's verdict and, on rank 0, prints one line per case:

    torch[np=4] PASS name (1.2s)
    torch[np=4] FAIL name: rank 2: <error>

Every collective of the job has the process group's timeout (EPX_TORCH_TIMEOUT seconds,
default 300: generous, since the ranks of a job share a few cores with whatever else runs),
so a case that would hang fails instead.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

_results: list[tuple[str, bool]] = []


def init(cuda: bool = False) -> tuple[int, int]:
    """gloo; with `cuda`, gloo for CPU tensors and NCCL for CUDA ones, each rank on GPU
    local_rank % device_count (when there is one)."""
    if not dist.is_initialized():
        timeout = float(os.environ.get("EPX_TORCH_TIMEOUT", "300"))
        backend = "gloo"
        if cuda and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    torch.set_num_threads(int(os.environ.get("EPX_TORCH_THREADS", "1")))
    return dist.get_rank(), dist.get_world_size()


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def run(name: str, fn) -> bool:
    W = dist.get_world_size()
    t0 = time.time()
    try:
        fn()
        verdict = (True, "")
    except Exception as e:  # noqa: BLE001 - every failure is reported, not raised
        verdict = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
    all_verdicts: list = [None] * W
    dist.all_gather_object(all_verdicts, verdict)
    ok = all(v[0] for v in all_verdicts)
    _results.append((name, ok))
    dt = time.time() - t0
    if ok:
        say(f"torch[np={W}] PASS {name} ({dt:.1f}s)")
    else:
        bad = [f"rank {r}: {v[1]}" for r, v in enumerate(all_verdicts) if not v[0]]
        say(f"torch[np={W}] FAIL {name} ({dt:.1f}s)\n  " + "\n  ".join(bad))
    return ok


def enough_gpus() -> bool:
    """Whether every rank has a GPU of its own (NCCL needs one per rank); the reason why
    not is left in enough_gpus.reason."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    W = dist.get_world_size()
    enough_gpus.reason = f"{n} GPU(s) visible for {W} rank(s) on this host" if n < W else ""
    return n >= W


def skip(name: str, reason: str) -> None:
    """A case that cannot run here: SKIP with the reason, counted neither passed nor failed."""
    say(f"torch[np={dist.get_world_size()}] SKIP {name}: {reason}")


def summary() -> tuple[int, int]:
    passed = sum(1 for _, ok in _results if ok)
    failed = len(_results) - passed
    say(f"torch[np={dist.get_world_size()}] RESULT passed={passed} failed={failed}")
    return passed, failed


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} but expected {tuple(want.shape)}")
    e = rel_err(got, want)
    if not e <= tol:
        raise AssertionError(f"{what}: relative error {e:.3e} above {tol:.3e}")
    return e


def check_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: not bitwise equal (relative error {rel_err(got, want):.3e})")


def expect_error(fn, *parts: str, error=None) -> str:
    """fn must raise `error` (default epx_torch.EpxError) whose message holds every part."""
    import epx_torch

    error = error or epx_torch.EpxError
    try:
        fn()
    except error as e:
        msg = str(e)
        missing = [p for p in parts if p not in msg]
        if missing:
            raise AssertionError(f"error message lacks {missing}: {msg}") from None
        return msg
    raise AssertionError(f"no {error.__name__} raised (expected one naming {list(parts)})")


def finish(failed: int) -> None:
    """Ends the job: the exit status is the verdict. os._exit skips the interpreter's
    teardown, where torch 2.15's gloo threads now and then abort a process ("terminate called
    without an active exception", seen without epx_torch too) after every case has passed.
    The teardown users go through, with epx_torch's layers alive, is exit_clean.py's test."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)
