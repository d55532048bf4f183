"""Builds (once) and loads the C++ extension epx_torch._C against the installed torch.

The extension is compiled (C++20, as torch 2.15 requires; the core is C++17 and compiles
under both) by torch.utils.cpp_extension.load from bindings/torch/csrc with
epx's headers (the repository's include/); the core stays header-only and knows nothing of
torch. The build directory is EPX_TORCH_BUILD_DIR, by default
~/.cache/epx/torch-build/<torch version>; ninja rebuilds only what changed.
"""

from __future__ import annotations

import os
import pathlib

_HERE = pathlib.Path(__file__).resolve().parent
_BINDINGS = _HERE.parent
_REPO = _BINDINGS.parent.parent


def include_dir() -> pathlib.Path:
    """The directory that holds epx/epx.hpp: EPX_INCLUDE_DIR, else the repository's include/."""
    env = os.environ.get("EPX_INCLUDE_DIR")
    return pathlib.Path(env) if env else _REPO / "include"


def load(verbose: bool | None = None):
    import torch
    from torch.utils import cpp_extension

    if verbose is None:
        verbose = os.environ.get("EPX_TORCH_VERBOSE_BUILD", "") not in ("", "0")
    build_dir = pathlib.Path(
        os.environ.get("EPX_TORCH_BUILD_DIR")
        or pathlib.Path.home() / ".cache" / "epx" / "torch-build" / torch.__version__.replace("+", "_")
    )
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(_BINDINGS / "csrc" / f) for f in ("module.cpp", "layer.cpp", "reference.cpp")]
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-fast-math", "-ffp-contract=off"]
    return cpp_extension.load(
        name="epx_torch_C",
        sources=sources,
        extra_include_paths=[str(include_dir()), str(_BINDINGS / "csrc")],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        with_cuda=False,
        verbose=verbose,
    )
