#!/usr/bin/env python3
"""Checks that epx's headers compile without a warning under strict flags.

A project that builds with -Wconversion, -Wsign-conversion and -Wshadow (often with -Werror)
and includes epx's headers without marking them as system headers sees every warning in
them. The headers are templates: a warning shows only where a template is instantiated. So
this check compiles the host test sources (-fsyntax-only; GCC and Clang instantiate the
templates they use there; the files of a unity label as one source, as the build does),
which instantiate the layer, its routes, policies, routing, hooks and communicators, and
the emulated device's variants, and fails if a warning points into the include directory.
Warnings in the tests' own code do not count.

    scripts/check-warnings.py --cxx g++ --repo . [--mpi-include DIR]... [--cccl-include DIR] [--jobs N]
    scripts/check-warnings.py --self-test ...   (same arguments)
        copies include/, plants an int -> size_t conversion in epx/core/config.hpp and
        passes only if the check reports it
"""
import argparse
import concurrent.futures
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

FLAGS = ["-std=c++17", "-fsyntax-only", "-fopenmp", "-pthread", "-Wall", "-Wextra", "-Wconversion",
         "-Wsign-conversion", "-Wshadow"]
WARNING = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): warning: (?P<text>.*)$", re.M)


# The folders whose host tests CMake compiles as one unity source (EPX_TEST_UNITY_LABELS:
# each file's names sit in a namespace of its own), less the files built on their own.
UNITY = {"core", "comm", "emulated"}
STANDALONE = {"test_layout.cpp"}


def sources(repo: pathlib.Path, mpi: bool):
    """(sources, extra flags) groups: the host tests of the core, comm, emulated and
    reliability folders, the MPI ones only with MPI's include directories. A group of
    several files compiles as one source that includes them (the unity sources of the
    build): the templates they share are instantiated, and checked, once."""
    emulated = ["-DEPX_TEST_EXEC=::epx::exec::emulated_device", "-DEPX_EMULATE_DEVICE_ALGORITHMS=1"]
    out = []
    for folder in ["core", "comm", "emulated", "reliability"]:
        extra = emulated if folder == "emulated" else []
        unity = []
        for src in sorted((repo / "tests" / folder).glob("*.cpp")):
            if src.stem.endswith("_mpi") and not mpi:
                continue
            if folder in UNITY and not src.stem.endswith("_mpi") and src.name not in STANDALONE:
                unity.append(src)
            else:
                out.append(([src], extra))
        if unity:
            out.insert(0, (unity, extra))  # the longest compiles first
    return out


def check(args, include: pathlib.Path, only: str = ""):
    """Warnings located under `include`, one line each, the sources that did not compile, and
    the number of sources compiled (those of the group that holds `only`, when given)."""
    repo = pathlib.Path(args.repo).resolve()
    include = include.resolve()
    common = [f"-I{include}", f"-I{repo / 'tests'}"]
    common += [f"-isystem{d}" for d in args.mpi_include]
    if args.cccl_include:
        common += [f"-isystem{args.cccl_include}", "-DEPX_HAS_CCCL=1"]
    groups = sources(repo, bool(args.mpi_include))
    if only:  # the group that holds the file (its unity source, or the file alone)
        groups = [g for g in groups if any(src.name == only for src in g[0])]
    tmp = tempfile.TemporaryDirectory()

    def compile_one(item):
        files, extra = item
        src = files[0]
        if len(files) > 1:
            src = pathlib.Path(tmp.name) / f"unity_{files[0].parent.name}.cpp"
            src.write_text("".join(f'#include "{f}"\n' for f in files), encoding="utf-8")
        r = subprocess.run([args.cxx, *FLAGS, *common, *extra, str(src)], capture_output=True, text=True)
        found = []
        for m in WARNING.finditer(r.stderr):
            path = pathlib.Path(m.group("file"))
            path = path if path.is_absolute() else (repo / path)
            try:
                rel = path.resolve().relative_to(include)
            except ValueError:
                continue  # the test's own code, or a system header
            found.append(f"{rel}:{m.group('line')}:{m.group('col')}: {m.group('text')}")
        failed = r.returncode != 0
        name = str(files[0].relative_to(repo)) if len(files) == 1 else \
            f"the {len(files)} files of tests/{files[0].parent.name} (one unity source)"
        return name, found, (r.stderr if failed else "")

    bad, errors = set(), []
    with tmp, concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for name, found, err in pool.map(compile_one, groups):
            bad.update(found)
            if err:
                errors.append(f"{name} does not compile:\n{err[:4000]}")
    return sorted(bad), errors, sum(len(files) for files, _ in groups)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cxx", default="c++")
    p.add_argument("--repo", default=".")
    p.add_argument("--mpi-include", action="append", default=[])
    p.add_argument("--cccl-include", default="")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--self-test", action="store_true")
    args = p.parse_args()
    include = pathlib.Path(args.repo) / "include"
    if args.self_test:
        with tempfile.TemporaryDirectory() as tmp:
            copy = pathlib.Path(tmp) / "include"
            shutil.copytree(include, copy)
            victim = copy / "epx" / "core" / "config.hpp"
            text = victim.read_text(encoding="utf-8")
            plant = "\nnamespace epx::detail {\ninline unsigned long planted_conversion(int i) { return i; }\n}\n"
            victim.write_text(text + plant, encoding="utf-8")
            # One source sees it; it compiles in its folder's unity source, as the check does.
            bad, errors, n = check(args, copy, only="test_numeric.cpp")
            if n < 1:
                print("check-warnings self-test: tests/core/test_numeric.cpp is missing")
                return 1
            if errors:
                print("check-warnings self-test: a source did not compile:", *errors, sep="\n")
                return 1
            if not any(b.startswith("epx/core/config.hpp:") and "sign" in b for b in bad):
                print("check-warnings self-test: FAILED, the planted conversion was not reported; found:", *bad,
                      sep="\n  ")
                return 1
            print(f"check-warnings self-test: passed (the planted conversion reported, {n} sources compiled "
                  "as one)")
            return 0
    bad, errors, n = check(args, include)
    for e in errors:
        print(e)
    for b in bad:
        print(b)
    print(f"check-warnings: {n} sources, {len(bad)} warning(s) in include/, {len(errors)} source(s) not compiled "
          f"(flags: {' '.join(FLAGS[1:])})")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
