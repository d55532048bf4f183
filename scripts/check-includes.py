#!/usr/bin/env python3
"""Checks the direction of epx's includes.

The folders of include/epx are ordered along the data flow:

    core, exec, mesh, comm, routing, layout, kernels, impl, layer, grad

A header may include headers of its own folder and of earlier folders only; the umbrella
headers at the top (epx/epx.hpp) may include any folder's. Every epx/ header included must
exist, the umbrella's too. Prints every include that points to a later folder or to a
missing header and exits 1 if there is one.

    scripts/check-includes.py [ROOT]     # ROOT: the include directory (default: include)
    scripts/check-includes.py --self-test ROOT
        copies ROOT, adds one upward include (epx/core/config.hpp including a layer header)
        and an include of a missing header to epx/core/config.hpp and to the umbrella
        epx/epx.hpp, and passes only if the check finds all three
"""
import pathlib
import re
import sys

ORDER = ["core", "exec", "mesh", "comm", "routing", "layout", "kernels", "impl", "layer", "grad"]
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]epx/([^>"]+)[>"]', re.M)


def folder(rel: str):
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else None  # None: a top-level umbrella header


def check(root: pathlib.Path):

    base = root / "epx"
    if not base.is_dir():
        return None, [f"no epx/ folder under {root}"]
    bad = []
    headers = sorted(p for p in base.rglob("*") if p.suffix in (".hpp", ".cuh", ".h"))
    for path in headers:
        rel = path.relative_to(base).as_posix()
        own = folder(rel)
        text = path.read_text(encoding="utf-8")
        if own is None:  # an umbrella header: any folder, but only headers that exist
            for m in INCLUDE.finditer(text):
                if not (base / m.group(1)).is_file():
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"epx/{rel}:{line}: includes epx/{m.group(1)}, which does not exist")
            continue
        if own not in ORDER:
            bad.append(f"epx/{rel}: folder '{own}' is not in the order {ORDER}")
            continue
        for m in INCLUDE.finditer(text):
            target = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            to = folder(target)
            if to is None:
                bad.append(f"epx/{rel}:{line}: includes the umbrella header epx/{target}")
            elif to not in ORDER:
                bad.append(f"epx/{rel}:{line}: includes epx/{target} from unknown folder '{to}'")
            elif ORDER.index(to) > ORDER.index(own):
                bad.append(f"epx/{rel}:{line}: upward include of epx/{target} ('{to}' comes after '{own}')")
            elif not (base / target).is_file():
                bad.append(f"epx/{rel}:{line}: includes epx/{target}, which does not exist")
    return len(headers), bad


def self_test(root: pathlib.Path) -> int:
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp) / "include"
        shutil.copytree(root, copy)
        n, bad = check(copy)
        if bad:
            print("check-includes self-test: the tree is not clean to start with:", *bad, sep="\n  ")
            return 1
        victim = copy / "epx" / "core" / "config.hpp"
        victim.write_text(victim.read_text(encoding="utf-8") +
                          '\n#include "epx/layer/moe_layer.hpp"\n#include "epx/core/no_such_header.hpp"\n')
        umbrella = copy / "epx" / "epx.hpp"
        umbrella.write_text(umbrella.read_text(encoding="utf-8") + '\n#include "epx/layer/no_such_layer.hpp"\n')
        _, bad = check(copy)
        want = ["upward include of epx/layer/moe_layer.hpp", "epx/core/no_such_header.hpp, which does not exist",
                "epx/epx.hpp:", "epx/layer/no_such_layer.hpp, which does not exist"]
        missing = [w for w in want if not any(w in b for b in bad)]
        for b in bad:
            print("  found:", b)
        if missing:
            print("check-includes self-test: FAILED, the check missed:", *missing, sep="\n  ")
            return 1
        print(f"check-includes self-test: passed ({len(bad)} planted problem(s) found in {n} headers)")
        return 0


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] == "--self-test":
        return self_test(pathlib.Path(args[1] if len(args) > 1 else "include"))
    n, bad = check(pathlib.Path(args[0] if args else "include"))
    for b in bad:
        print(b)
    print(f"check-includes: {n} headers, {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
