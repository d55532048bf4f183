"""Entry point of the torch tests, under torchrun (gloo, CPU):

    torchrun --nproc-per-node=N bindings/torch/tests/run.py [--transformers] [--bench] [--doc]
                                                            [--device emulated|cuda]

runs the ops suite (test_ops.py) and, when asked, the comparison with transformers'
expert parallelism (test_transformers.py, 8 processes), the benchmark (bench.py, 8
processes), the example of docs/pytorch.md and the device layers against the host layer
(test_device.py: --device cuda on GPUs, NCCL; --device emulated on the CPU). Rank 0 prints one line per case and
`torch[np=N] RESULT passed=P failed=F`; the exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import harness  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transformers", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--doc", action="store_true")
    ap.add_argument("--no-ops", action="store_true")
    ap.add_argument("--device", choices=("emulated", "cuda"), default=None)
    ap.add_argument("--only", default="", help="run only the cases whose name holds this text")
    args = ap.parse_args()
    rank, W = harness.init(cuda=args.device == "cuda")
    import epx_torch  # noqa: F401  (builds or loads the extension)

    if not args.no_ops:
        import test_ops

        for name, fn in test_ops.cases(W):
            if args.only in name:
                harness.run(name, fn)
    if args.doc:
        import test_doc

        for name, fn in test_doc.cases(W):
            harness.run(name, fn)
    if args.device:
        import test_device

        if args.device == "cuda" and not harness.enough_gpus():
            harness.skip(f"{args.device}: the device layer against the host layer",
                         harness.enough_gpus.reason)
        else:
            for name, fn in test_device.cases(W, args.device):
                if args.only in name:
                    harness.run(name, fn)
    if args.transformers:
        import test_transformers

        for name, fn in test_transformers.cases(W):
            if args.only in name:
                harness.run(name, fn)
    if args.bench:
        import bench

        for name, fn in bench.cases(W):
            harness.run(name, fn)
    def no_shm_names_left():
        # Every buffer name is removed once mapped (or on a timeout): none of this process's.
        import glob
        import torch.distributed as dist

        dist.barrier()
        left = glob.glob(f"/dev/shm/epx.{os.getpid()}.*")
        if left:
            raise AssertionError(f"shared-memory names left behind: {left}")

    harness.run("no shared-memory names left in /dev/shm", no_shm_names_left)
    _, failed = harness.summary()
    harness.finish(failed)


if __name__ == "__main__":
    main()
