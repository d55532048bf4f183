"""Builds (once) and loads the C++ extension epx_torch._C against the installed torch.

The extension is compiled (C++20, as torch 2.15 requires; the core is C++17 and compiles
under both) by torch.utils.cpp_extension.load from bindings/torch/csrc with
epx's headers (the repository's include/); the core stays header-only and knows nothing of
torch. The build directory is EPX_TORCH_BUILD_DIR, by default
~/.cache/epx/torch-build/<torch version>-<key>, where <key> is a hash of the absolute paths
of the sources and of the headers: every copy of the repository builds into its own
directory. (One directory shared by two copies would be rebuilt by each in turn, since
torch writes the sources' paths into its build file: the processes of a job that import
epx_torch then wait on the build lock for minutes while another copy's job rebuilds, and
may load the other copy's module.) ninja rebuilds only what changed.

With CUDA (`cuda=True`: EPX_TORCH_CUDA=1, or by default where torch sees a GPU) the
extension is epx_torch_cuda_C: the same sources and layer_cuda.cu, compiled by nvcc for
TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), which adds the CUDA layer (_CudaLayer: CUDA
tensors on torch's current stream over the group's NCCL backend). One process loads one of
the two.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

_HERE = pathlib.Path(__file__).resolve().parent
_BINDINGS = _HERE.parent
_REPO = _BINDINGS.parent.parent


def include_dir() -> pathlib.Path:
    """The directory that holds epx/epx.hpp: EPX_INCLUDE_DIR, else the repository's include/."""
    env = os.environ.get("EPX_INCLUDE_DIR")
    return pathlib.Path(env) if env else _REPO / "include"


def build_dir(torch_version: str, cuda: bool = False) -> pathlib.Path:
    """Where the extension is built: EPX_TORCH_BUILD_DIR (with /cuda for the CUDA build),
    else one directory per torch version, per build and per copy of the sources and headers
    (see the module's docstring)."""
    env = os.environ.get("EPX_TORCH_BUILD_DIR")
    if env:
        return pathlib.Path(env) / "cuda" if cuda else pathlib.Path(env)
    key = hashlib.sha256(f"{_BINDINGS.resolve()}\n{include_dir().resolve()}".encode()).hexdigest()[:12]
    kind = "-cuda" if cuda else ""
    return pathlib.Path.home() / ".cache" / "epx" / "torch-build" / f"{torch_version.replace('+', '_')}-{key}{kind}"


def wants_cuda() -> bool:
    """EPX_TORCH_CUDA=1 or 0 decides; by default the CUDA build where torch sees a GPU."""
    env = os.environ.get("EPX_TORCH_CUDA", "")
    if env in ("0", "1"):
        return env == "1"
    import torch

    return torch.cuda.is_available()


def load(verbose: bool | None = None, cuda: bool | None = None):
    import torch
    from torch.utils import cpp_extension

    if verbose is None:
        verbose = os.environ.get("EPX_TORCH_VERBOSE_BUILD", "") not in ("", "0")
    if cuda is None:
        cuda = wants_cuda()
    where = build_dir(torch.__version__, cuda)
    where.mkdir(parents=True, exist_ok=True)
    names = ["module.cpp", "layer.cpp", "reference.cpp"] + (["layer_cuda.cu"] if cuda else [])
    sources = [str(_BINDINGS / "csrc" / f) for f in names]
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-fast-math", "-ffp-contract=off"]
    extra = {}
    if cuda:
        flags.append("-DEPX_TORCH_WITH_CUDA=1")
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        extra["extra_cuda_cflags"] = ["-O3", "--extended-lambda", "--expt-relaxed-constexpr",
                                      "-DEPX_TORCH_WITH_CUDA=1"]
    return cpp_extension.load(
        name="epx_torch_cuda_C" if cuda else "epx_torch_C",
        sources=sources,
        extra_include_paths=[str(include_dir()), str(_BINDINGS / "csrc")],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(where),
        with_cuda=cuda,
        verbose=verbose,
        **extra,
    )
