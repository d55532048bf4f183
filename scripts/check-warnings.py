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

Which folders compile as one unity source, and which of their files keep a source of their own,
is tests/CMakeLists.txt's to say (EPX_TEST_UNITY_LABELS, _epx_standalone_tests): CMake passes
its values (--unity-labels, --standalone); run by hand without them, the script reads the two
`set(...)` lines of tests/CMakeLists.txt and stops with an error if either is missing or has
changed shape.

    scripts/check-warnings.py --cxx g++ --repo . [--mpi-include DIR]... [--cccl-include DIR] [--jobs N]
                              [--unity-labels=comm,core,emulated] [--standalone=test_core_test_layout]
    scripts/check-warnings.py --self-test ...   (same arguments)
        copies include/, plants an int -> size_t conversion in epx/core/config.hpp and
        passes only if the check reports it; also fails if tests/CMakeLists.txt's two lines
        no longer parse, or name other standalone targets than --standalone
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


# The two lines of tests/CMakeLists.txt that say which folders' host tests compile as one
# unity source (each file's names sit in a namespace of its own) and which of their files
# (by target name, test_<folder>_<name>) keep an executable of their own. Read only when CMake
# did not pass its values (then EPX_TEST_UNITY_LABELS is its default). Each variable must be
# written on exactly one line (set, unset or list(<op>) of it), of exactly this shape: any
# other is an error, not a guess.
CMAKE_LISTS = pathlib.Path("tests") / "CMakeLists.txt"
CMAKE_LINES = {
    "unity_labels": ("EPX_TEST_UNITY_LABELS",
                     re.compile(r'set\(EPX_TEST_UNITY_LABELS "(?P<value>[A-Za-z0-9_;]*)" CACHE STRING'),
                     'set(EPX_TEST_UNITY_LABELS "<label>;..." CACHE STRING'),
    "standalone": ("_epx_standalone_tests",
                   re.compile(r"set\(_epx_standalone_tests(?P<value>(?: [A-Za-z0-9_]+)*)\)"),
                   "set(_epx_standalone_tests <target> ...)"),
}


def split_list(text: str):
    """A CMake list (;) or a comma-separated one, as a set; empty items dropped."""
    return {item for item in re.split(r"[;,\s]+", text) if item}


def cmake_lists_values(repo: pathlib.Path, name: str):
    """The value of one of CMAKE_LINES in tests/CMakeLists.txt; exits with a message when the
    variable is written on no line or on several, or its line has another shape."""
    var, pattern, shape = CMAKE_LINES[name]
    path = repo / CMAKE_LISTS
    writes = re.findall(rf"^[ \t]*(?:set|unset|list[ \t]*\([ \t]*[A-Za-z_]+)[ \t]*[( \t][ \t]*{var}\b.*$",
                        path.read_text(encoding="utf-8"), re.M)
    match = pattern.fullmatch(writes[0].strip()) if len(writes) == 1 else None
    if not match:
        sys.exit(f"check-warnings: {path} should write {var} on exactly one line, of the shape `{shape}`; "
                 f"found: {writes}. Pass --{name.replace('_', '-')}= (CMake does), or update CMAKE_LINES in "
                 f"{pathlib.Path(__file__).name}")
    return split_list(match.group("value"))


def sources(repo: pathlib.Path, mpi: bool, unity_labels, standalone):
    """(sources, extra flags) groups: the host tests of the core, comm, emulated and
    reliability folders, the MPI ones only with MPI's include directories. The host tests of
    a folder in `unity_labels`, less the targets in `standalone`, compile as one source that
    includes them (the unity sources of the build): the templates they share are
    instantiated, and checked, once."""
    emulated = ["-DEPX_TEST_EXEC=::epx::exec::emulated_device", "-DEPX_EMULATE_DEVICE_ALGORITHMS=1"]
    out = []
    for folder in ["core", "comm", "emulated", "reliability"]:
        extra = emulated if folder == "emulated" else []
        unity = []
        for src in sorted((repo / "tests" / folder).glob("*.cpp")):
            if src.stem.endswith("_mpi") and not mpi:
                continue
            if folder in unity_labels and not src.stem.endswith("_mpi") and \
                    f"test_{folder}_{src.stem}" not in standalone:
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
    groups = sources(repo, bool(args.mpi_include), args.unity_labels, args.standalone)
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
    p.add_argument("--unity-labels", default=None,
                   help="EPX_TEST_UNITY_LABELS (; or , between labels; default: read from tests/CMakeLists.txt)")
    p.add_argument("--standalone", default=None,
                   help="the unity labels' targets built on their own (default: read from tests/CMakeLists.txt)")
    p.add_argument("--self-test", action="store_true")
    args = p.parse_args()
    repo = pathlib.Path(args.repo)
    for name in CMAKE_LINES:
        value = getattr(args, name)
        setattr(args, name, split_list(value) if value is not None else cmake_lists_values(repo, name))
    include = pathlib.Path(args.repo) / "include"
    if args.self_test:
        # A hand run reads tests/CMakeLists.txt: its two lines must still parse (this exits
        # if not), and the standalone targets, not a cache variable, must be those passed.
        for name in CMAKE_LINES:
            read = cmake_lists_values(repo, name)
            if name == "standalone" and read != args.standalone:
                print(f"check-warnings self-test: --standalone gives {sorted(args.standalone)}, "
                      f"{CMAKE_LISTS} {sorted(read)}")
                return 1
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
            how = f"{n} sources compiled as one" if n > 1 else "test_numeric.cpp compiled alone"
            print(f"check-warnings self-test: passed (the planted conversion reported, {how})")
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
