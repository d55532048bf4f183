#!/usr/bin/env python3
"""Checks that epx's headers compile without a warning under strict flags.

A project that builds with -Wconversion, -Wsign-conversion and -Wshadow (often with -Werror)
and includes epx's headers without marking them as system headers sees every warning in
them. The headers are templates: a warning shows only where a template is instantiated. So
this check compiles the host test sources (-fsyntax-only; GCC and Clang instantiate the
templates they use there; the files of a unity label as one source, as the build does),
which instantiate the layer, its routes, policies, routing, hooks and communicators, and
the emulated device's variants, and fails if a warning points into the include directory
or a source does not compile. Warnings in the tests' own code do not count.

--sources picks what is compiled (comma-separated; default tests):
    tests       the host tests of tests/{core,comm,emulated,reliability}, the MPI ones
                (*_mpi.cpp) only with --mpi-include
    mpi-tests   only those MPI tests; without --mpi-include the check is skipped (exit 77)
    bench       bench/*.cpp (Google Benchmark's headers from --bench-include, or the
                compiler's own search path), bench/*_mpi.cpp only with --mpi-include
The build's compiler checks the tests (ctest structure_strict_warnings); a second one,
clang++ where the build's is GCC, checks the MPI tests and the benchmarks
(structure_strict_warnings_clang), the sources the asan preset, the only one built by
Clang, leaves out. A --cxx that is not found skips the check (exit 77).

Which folders compile as one unity source, and which of their files keep a source of their own,
is tests/CMakeLists.txt's to say (EPX_TEST_UNITY_LABELS, _epx_standalone_tests): CMake passes
its values (--unity-labels, --standalone); run by hand without them, the script reads the two
`set(...)` lines of tests/CMakeLists.txt and stops with an error if either is missing or has
changed shape.

    scripts/check-warnings.py --cxx g++ --repo . [--sources tests,mpi-tests,bench]
                              [--mpi-include DIR]... [--cccl-include DIR] [--bench-include DIR]...
                              [--unity-labels=comm,core,emulated] [--standalone=test_core_test_layout]
                              [--jobs N]
    scripts/check-warnings.py --self-test ...   (same arguments)
        copies include/, plants an int -> size_t conversion in epx/core/config.hpp and
        passes only if the check reports it through one source of each set of --sources
        (tests: tests/core/test_numeric.cpp and test_host_isa.cpp as one unity source, as
        the check compiles a unity folder; mpi-tests: tests/core/test_hooks_mpi.cpp; bench:
        bench/bench_comm_mpi.cpp, bench_comm.cpp without MPI), then plants an undeclared
        name there and passes only if the first of those sources (test_numeric.cpp alone)
        is reported as not compiling; also fails if
        tests/CMakeLists.txt's two lines no longer parse, or name other standalone targets
        than --standalone

    e.g. the second compiler by hand:
    scripts/check-warnings.py --cxx clang++ --sources mpi-tests,bench \\
        --mpi-include /usr/lib/x86_64-linux-gnu/openmpi/include \\
        --mpi-include /usr/lib/x86_64-linux-gnu/openmpi/include/openmpi
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
SKIPPED = 77  # ctest's SKIP_RETURN_CODE for the checks
SOURCE_SETS = ("tests", "mpi-tests", "bench")
TEST_FOLDERS = ("core", "comm", "emulated", "reliability")
# The sources of each set that the self-test compiles: for tests two small files of a unity
# folder, compiled as one unity source of their own (the check's unity path, in a second
# rather than the minute and a half of the folder's whole source).
PROBES = {"tests": ["tests/core/test_numeric.cpp", "tests/core/test_host_isa.cpp"],
          "mpi-tests": ["tests/core/test_hooks_mpi.cpp"], "bench": ["bench/bench_comm_mpi.cpp"]}
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


def sources(repo: pathlib.Path, sets, mpi: bool, unity_labels, standalone):
    """(sources, kind) groups, kind "tests", "emulated" or "bench": the host tests of the
    core, comm, emulated and reliability folders (set tests; mpi-tests: their MPI ones only)
    and the benchmarks (set bench), anything named *_mpi.cpp only with MPI's include
    directories. The host tests of a folder in `unity_labels`, less the targets in
    `standalone`, compile as one source that includes them (the unity sources of the build):
    the templates they share are instantiated, and checked, once."""
    out = []
    for folder in TEST_FOLDERS if {"tests", "mpi-tests"} & set(sets) else ():
        kind = "emulated" if folder == "emulated" else "tests"
        unity = []
        for src in sorted((repo / "tests" / folder).glob("*.cpp")):
            is_mpi = src.stem.endswith("_mpi")
            if (is_mpi and not mpi) or (not is_mpi and "tests" not in sets):
                continue
            if folder in unity_labels and not is_mpi and f"test_{folder}_{src.stem}" not in standalone:
                unity.append(src)
            else:
                out.append(([src], kind))
        if unity:
            out.insert(0, (unity, kind))  # the longest compiles first
    if "bench" in sets:
        out += [([src], "bench") for src in sorted((repo / "bench").glob("*.cpp"))
                if mpi or not src.stem.endswith("_mpi")]
    return out


def check(args, include: pathlib.Path, probes=(), alone=False):
    """One (name, warnings located under `include`, one line each, the compiler's output if
    the source did not compile) per group compiled: every group of the sources, or those
    that hold one of `probes` (paths relative to the repository), or with `alone` only the
    probes themselves."""
    repo = pathlib.Path(args.repo).resolve()
    include = include.resolve()
    common = [f"-I{include}"] + [f"-isystem{d}" for d in args.mpi_include]
    tests = [f"-I{repo / 'tests'}"]
    if args.cccl_include:
        tests += [f"-isystem{args.cccl_include}", "-DEPX_HAS_CCCL=1"]
    extra = {"tests": tests,
             "emulated": tests + ["-DEPX_TEST_EXEC=::epx::exec::emulated_device", "-DEPX_EMULATE_DEVICE_ALGORITHMS=1"],
             "bench": [f"-isystem{d}" for d in args.bench_include]}
    groups = sources(repo, args.sources, bool(args.mpi_include), args.unity_labels, args.standalone)
    if probes:  # the groups that hold them (a unity source, or the file alone)
        wanted = {repo / p for p in probes}
        groups = [([f for f in files if f in wanted] if alone else files, kind) for files, kind in groups
                  if wanted & set(files)]
    tmp = tempfile.TemporaryDirectory()

    def compile_one(item):
        files, kind = item
        src = files[0]
        if len(files) > 1:
            src = pathlib.Path(tmp.name) / f"unity_{files[0].parent.name}.cpp"
            src.write_text("".join(f'#include "{f}"\n' for f in files), encoding="utf-8")
        r = subprocess.run([args.cxx, *FLAGS, *common, *extra[kind], str(src)], capture_output=True, text=True)
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

    with tmp, concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(compile_one, groups))


def self_test(args, include: pathlib.Path, repo: pathlib.Path) -> int:
    """Plants a conversion, then an undeclared name, in a copy of include/ (see the top)."""
    # A hand run reads tests/CMakeLists.txt: its two lines must still parse (this exits if
    # not), and the standalone targets, not a cache variable, must be those passed.
    for name in CMAKE_LINES:
        read = cmake_lists_values(repo, name)
        if name == "standalone" and read != args.standalone:
            print(f"check-warnings self-test: --standalone gives {sorted(args.standalone)}, "
                  f"{CMAKE_LISTS} {sorted(read)}")
            return 1
    probes = [p for s in args.sources
              for p in (PROBES[s] if s != "bench" or args.mpi_include else ["bench/bench_comm.cpp"])]
    for probe in probes:
        if not (repo / probe).is_file():
            print(f"check-warnings self-test: {probe} is missing")
            return 1
    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp) / "include"
        shutil.copytree(include, copy)
        victim = copy / "epx" / "core" / "config.hpp"
        text = victim.read_text(encoding="utf-8")
        plant = "\nnamespace epx::detail {\ninline unsigned long planted_conversion(int i) { return i; }\n}\n"
        victim.write_text(text + plant, encoding="utf-8")
        # Each probe's group sees it (the tests' probes as one unity source, as the check
        # compiles a folder).
        results = check(args, copy, probes, alone=True)
        for name, found, err in results:
            if err:
                print(f"check-warnings self-test: {name} did not compile:\n{err[:4000]}")
                return 1
            if not any(b.startswith("epx/core/config.hpp:") and "sign" in b for b in found):
                print(f"check-warnings self-test: FAILED, {args.cxx} did not report the planted conversion "
                      f"through {name}; found:", *found, sep="\n  ")
                return 1
        # A source that does not compile fails the check: the first probe alone.
        plant = "\nnamespace epx::detail {\ninline int planted_error() { return planted_undeclared_name; }\n}\n"
        victim.write_text(text + plant, encoding="utf-8")
        failed = check(args, copy, probes[:1], alone=True)
        if len(failed) != 1 or not failed[0][2]:
            print(f"check-warnings self-test: FAILED, {probes[0]} compiled with the planted undeclared name")
            return 1
        if "planted_undeclared_name" not in failed[0][2]:
            print(f"check-warnings self-test: FAILED, {probes[0]} failed for another reason:\n{failed[0][2][:4000]}")
            return 1
    print(f"check-warnings self-test: passed ({args.cxx} reported the planted conversion through "
          f"{', '.join(name for name, _, _ in results)}, and {probes[0]} failed with the planted undeclared name)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cxx", default="c++")
    p.add_argument("--repo", default=".")
    p.add_argument("--sources", default="tests", help=f"comma-separated, of {', '.join(SOURCE_SETS)}")
    p.add_argument("--mpi-include", action="append", default=[])
    p.add_argument("--cccl-include", default="")
    p.add_argument("--bench-include", action="append", default=[], help="Google Benchmark's include directory")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--unity-labels", default=None,
                   help="EPX_TEST_UNITY_LABELS (; or , between labels; default: read from tests/CMakeLists.txt)")
    p.add_argument("--standalone", default=None,
                   help="the unity labels' targets built on their own (default: read from tests/CMakeLists.txt)")
    p.add_argument("--self-test", action="store_true")
    args = p.parse_args()
    given = split_list(args.sources)
    unknown = given - set(SOURCE_SETS)
    args.sources = [s for s in SOURCE_SETS if s in given]
    if unknown or not args.sources:
        p.error(f"--sources: {', '.join(sorted(unknown)) or 'none given'} (known: {', '.join(SOURCE_SETS)})")
    repo = pathlib.Path(args.repo)
    for name in CMAKE_LINES:
        value = getattr(args, name)
        setattr(args, name, split_list(value) if value is not None else cmake_lists_values(repo, name))
    if shutil.which(args.cxx) is None:
        print(f"check-warnings: skipped, the compiler {args.cxx} was not found")
        return SKIPPED
    if "mpi-tests" in args.sources and not args.mpi_include:
        print("check-warnings: skipped, the MPI tests need MPI's include directories (--mpi-include; MPI not "
              "found, or EPX_ENABLE_MPI=OFF)")
        return SKIPPED
    if args.self_test:
        return self_test(args, repo / "include", repo)
    results = check(args, repo / "include")
    bad = sorted({b for _, found, _ in results for b in found})
    errors = [f"{name} does not compile:\n{err[:4000]}" for name, _, err in results if err]
    for e in errors:
        print(e)
    for b in bad:
        print(b)
    n = sum(len(files) for files, _ in sources(repo, args.sources, bool(args.mpi_include), args.unity_labels,
                                                 args.standalone))
    print(f"check-warnings: {args.cxx}, {n} sources ({', '.join(args.sources)}), {len(bad)} warning(s) in "
          f"include/, {len(errors)} source(s) not compiled (flags: {' '.join(FLAGS[1:])})")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
