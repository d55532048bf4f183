#!/usr/bin/env python3
"""Plants known bugs in epx's headers, one at a time, and checks that a test catches each.

tests/mutations/catalog.json lists the bugs: each has a name, what the bug is, the edits
that plant it (a string of a header that occurs exactly once, and what replaces it) and the
test file that must fail with it (`cccl`: true for a bug of the Thrust route, compiled with
the CCCL headers: EPX_CCCL_INCLUDE_DIR, else a CUDA toolkit's include/cccl). For each bug the script copies include/, plants the bug
in the copy, compiles that test file against it (-O1, the way the unity build's files
compile alone; tests/emulated with the emulated device's definitions; *_mpi.cpp with mpicxx,
run under mpiexec) and runs it. A bug is caught when the test fails, crashes or ends on its
time limit; it survives when the test passes, which fails this check.

tests/mutations/bindings.json lists bugs of the PyTorch bindings (bindings/torch) in the
same form; their test is a file of bindings/torch/tests, and each names the cases to run
(`cases`: run.py's --only text), the number of processes (`np`, default 2) and, for the
emulated device layer's cases, `device` ("emulated"). The bindings are copied, with the bug,
into one directory per copy of the repository (~/.cache/epx/torch-mutants/<key>; only what
changed is written, so ninja rebuilds only the sources the bug touches), the extension is
built there with the virtual environment of scripts/run-torch-tests.sh (EPX_TORCH_VENV) and
the cases run under torchrun (gloo, CPU). These bugs run one after another.

    scripts/mutation-check.py                 # every bug (about half an hour on two cores for the
                                              # headers', as long again for the bindings')
    scripts/mutation-check.py --only NAME,... # some of them
    scripts/mutation-check.py --list          # names and bugs
    scripts/mutation-check.py --check-catalog # quick: every edit still applies exactly once
                                              # and every test file exists (ctest
                                              # structure_mutation_catalog)

A change that rewrites a planted line makes --check-catalog fail: plant the same bug in the
new code (or drop it, saying why) in the same change.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOG = ROOT / "tests" / "mutations" / "catalog.json"
BINDINGS = ROOT / "tests" / "mutations" / "bindings.json"
VENV = pathlib.Path(os.environ.get("EPX_TORCH_VENV", pathlib.Path.home() / ".cache" / "epx" / "torch-venv"))
EMULATED = ["-DEPX_TEST_EXEC=::epx::exec::emulated_device", "-DEPX_EMULATE_DEVICE_ALGORITHMS=1"]


def cccl_include():
    """The CCCL headers' folder (EPX_CCCL_INCLUDE_DIR, else a CUDA toolkit's include/cccl), or None."""
    env = os.environ.get("EPX_CCCL_INCLUDE_DIR")
    if env:
        return pathlib.Path(env) if (pathlib.Path(env) / "thrust").is_dir() else None
    for d in sorted(pathlib.Path("/usr/local").glob("cuda*/include/cccl"), reverse=True):
        if (d / "thrust").is_dir():
            return d
    return None


def load():
    bugs = json.loads(CATALOG.read_text(encoding="utf-8"))
    if BINDINGS.is_file():
        bugs += json.loads(BINDINGS.read_text(encoding="utf-8"))
    return bugs


def is_torch(b) -> bool:
    return b["test"].startswith("bindings/torch/")


def check_catalog(bugs) -> int:
    problems, names = [], set()
    for b in bugs:
        if b["name"] in names:
            problems.append(f"{b['name']}: the name is used twice")
        names.add(b["name"])
        if not (ROOT / b["test"]).is_file():
            problems.append(f"{b['name']}: test file {b['test']} does not exist")
        if is_torch(b) and not b.get("cases"):
            problems.append(f"{b['name']}: a bug of the bindings names no cases to run")
        for e in b["edits"]:
            path = ROOT / e["file"]
            n = path.read_text(encoding="utf-8").count(e["old"]) if path.is_file() else -1
            if n != 1:
                first = e["old"].strip().splitlines()[0] if e["old"].strip() else "(empty)"
                problems.append(f"{b['name']}: {e['file']} holds the planted text {n} times, not once: {first}")
            if e["old"] == e["new"]:
                problems.append(f"{b['name']}: an edit that changes nothing")
    for p in problems:
        print(p)
    print(f"mutation catalog: {len(bugs)} bugs, {len(problems)} problem(s)")
    return 1 if problems else 0


def compile_and_run(b, work: pathlib.Path, timeout: int):
    """'caught: ...', 'SURVIVED', or 'error: ...' (the mutated tree did not build as the test needs)."""
    inc = work / "include"
    shutil.copytree(ROOT / "include", inc)
    for e in b["edits"]:
        p = inc / pathlib.Path(e["file"]).relative_to("include")
        s = p.read_text(encoding="utf-8")
        if s.count(e["old"]) != 1:
            return f"error: {e['file']} holds the planted text {s.count(e['old'])} times"
        p.write_text(s.replace(e["old"], e["new"]), encoding="utf-8")
    test = b["test"]
    mpi = pathlib.Path(test).stem.endswith("_mpi")
    main = "tests/support/doctest_mpi_main.cpp" if mpi else "tests/support/doctest_main.cpp"
    exe = work / "t"
    cmd = ["mpicxx" if mpi else os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-fopenmp", "-pthread",
           f"-I{inc}", f"-I{ROOT / 'tests'}", str(ROOT / main), str(ROOT / test), "-o", str(exe)]
    if pathlib.Path(test).parent.name == "emulated":
        cmd[5:5] = EMULATED
    if b.get("cccl"):
        # A bug of the Thrust route (EPX_HAS_CCCL), which the emulated label's CMake build
        # takes where it finds the CCCL headers.
        cccl = cccl_include()
        if cccl is None:
            return "error: the bug needs the CCCL headers (EPX_CCCL_INCLUDE_DIR)"
        cmd[5:5] = ["-isystem", str(cccl), "-DEPX_HAS_CCCL=1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        # A planted bug the compiler refuses is caught at compile time only if the clean
        # tree compiles; the catalog's bugs all compile.
        return "error: does not compile: " + r.stderr.strip().splitlines()[0][:200]
    run = [str(exe)]
    env = dict(os.environ)
    if mpi:
        run = ["mpiexec", "--oversubscribe", "-n", "4", str(exe)]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    try:
        r = subprocess.run(run, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"caught: no end within {timeout} s"
    if r.returncode == 0:
        return "SURVIVED"
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "ERROR" in l or "FAILED" in l or "failed" in l]
    return "caught: " + (lines[0].strip()[:160] if lines else f"exit status {r.returncode}")


def write_if_changed(path: pathlib.Path, text: str) -> None:
    """Writes only a file whose text differs (a fresh time stamp: ninja rebuilds what uses it)."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def run_torch(b, timeout: int):
    """A bug of the bindings: planted in this copy's mutant tree, built, and its cases run."""
    import hashlib

    key = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    work = pathlib.Path.home() / ".cache" / "epx" / "torch-mutants" / key
    src = ROOT / "bindings" / "torch"
    files = {f.relative_to(ROOT): f.read_text(encoding="utf-8") for f in sorted(src.rglob("*"))
             if f.is_file() and f.suffix in (".py", ".cpp", ".hpp", ".cu", ".txt") and "__pycache__" not in f.parts}
    for e in b["edits"]:
        rel = pathlib.Path(e["file"])
        if rel not in files or files[rel].count(e["old"]) != 1:
            return f"error: {e['file']} holds the planted text {files.get(rel, '').count(e['old'])} times"
        files[rel] = files[rel].replace(e["old"], e["new"])
    for rel, text in files.items():
        write_if_changed(work / rel, text)
    env = dict(os.environ, PYTHONPATH=str(work / "bindings" / "torch"), EPX_INCLUDE_DIR=str(ROOT / "include"),
               EPX_TORCH_BUILD_DIR=str(work / "build"), EPX_TORCH_CUDA="0", OMP_NUM_THREADS="1",
               EPX_TORCH_TIMEOUT=os.environ.get("EPX_TORCH_TIMEOUT", "60"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(v, None)
    r = subprocess.run([str(VENV / "bin" / "python"), "-c", "import epx_torch"], capture_output=True, text=True,
                       env=env, cwd=work)
    if r.returncode != 0:
        err = [l for l in r.stderr.splitlines() if "error" in l.lower()]
        return "error: does not build: " + (err[0].strip()[:200] if err else f"exit status {r.returncode}")
    cmd = [str(VENV / "bin" / "torchrun"), "--standalone", f"--nproc-per-node={b.get('np', 2)}",
           str(work / "bindings" / "torch" / "tests" / "run.py"), "--only", b["cases"]]
    if b.get("device"):
        cmd += ["--device", b["device"]]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=work)
    except subprocess.TimeoutExpired:
        return f"caught: no end within {timeout} s"
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return "SURVIVED"
    lines = [l for l in out.splitlines() if " FAIL " in l]
    return "caught: " + (lines[0].strip()[:160] if lines else f"torchrun exit status {r.returncode}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated names")
    p.add_argument("--list", action="store_true")
    p.add_argument("--check-catalog", action="store_true")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--timeout", type=int, default=900, help="seconds a mutated test may run")
    args = p.parse_args()
    bugs = load()
    if args.check_catalog:
        return check_catalog(bugs)
    if args.list:
        for b in bugs:
            print(f"{b['name']:30} {b['test']:36} {b['bug']}")
        return 0
    if check_catalog(bugs):
        return 1
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {b["name"] for b in bugs}
        if unknown:
            print("unknown names:", ", ".join(sorted(unknown)))
            return 1
        bugs = [b for b in bugs if b["name"] in want]

    def one(b):
        with tempfile.TemporaryDirectory(prefix="epx-mutation-") as tmp:
            return b, compile_and_run(b, pathlib.Path(tmp), args.timeout)

    survived = errors = 0

    def report(b, verdict):
        nonlocal survived, errors
        survived += verdict == "SURVIVED"
        errors += verdict.startswith("error")
        print(f"{b['name']:30} {verdict}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for b, verdict in pool.map(one, [b for b in bugs if not is_torch(b)]):
            report(b, verdict)
    for b in bugs:  # one mutant tree: one after another
        if is_torch(b):
            report(b, run_torch(b, args.timeout))
    print(f"mutation check: {len(bugs)} bugs, {len(bugs) - survived - errors} caught, {survived} survived, "
          f"{errors} error(s)")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
