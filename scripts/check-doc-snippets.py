#!/usr/bin/env python3
"""Checks that code shown in the documents is the code that is compiled.

A fenced code block of README.md or docs/*.md that is immediately preceded by a line

    <!-- snippet: PATH START END -->

must equal, line by line, the lines of PATH (relative to the repository root) from the
first line that contains START through the first later line that equals END, both
included. START and END are words as a shell splits them: put one in double quotes when it
holds spaces. Trailing whitespace is ignored in the comparison and in the END match. The
comment line and the fence (```cpp or any ```) start in column 0. Example:

    <!-- snippet: tests/core/user_implementation.hpp "template <class Comm>" "};" -->
    ```cpp
    template <class Comm>
    ...
    };
    ```

Prints a unified diff for every block that differs, and every comment that is malformed,
not followed by a code block, or whose PATH, START or END cannot be found; exits 1 if there
is any.

    scripts/check-doc-snippets.py [ROOT]             # ROOT: the repository (default: .)
    scripts/check-doc-snippets.py --self-test [ROOT]
        copies the documents and the files they quote, checks that the copy passes, then
        changes one line of a quoted block and, separately, the START of one comment, and
        passes only if the check fails on each
"""
import difflib
import pathlib
import re
import shlex
import sys

COMMENT = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```")


def documents(root: pathlib.Path):
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    return [d for d in docs if d.is_file()]


def snippets(doc: pathlib.Path, root: pathlib.Path):
    """Yields (line number of the comment, args or None, block lines or None, problem)."""
    lines = doc.read_text(encoding="utf-8").split("\n")
    rel = doc.relative_to(root).as_posix()
    i = 0
    while i < len(lines):
        m = COMMENT.match(lines[i])
        if not m:
            i += 1
            continue
        at = f"{rel}:{i + 1}"
        try:
            args = shlex.split(m.group(1))
        except ValueError as e:
            yield at, None, None, f"cannot read the snippet comment ({e})"
            i += 1
            continue
        if len(args) != 3:
            yield at, None, None, f"the snippet comment needs PATH START END, got {len(args)} word(s): {args}"
            i += 1
            continue
        if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
            yield at, args, None, "the snippet comment is not immediately followed by a ``` code block"
            i += 1
            continue
        j = i + 2
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j >= len(lines):
            yield at, args, None, "the code block after the snippet comment is not closed"
            return
        yield at, args, lines[i + 2:j], None
        i = j + 1


def region(path: pathlib.Path, start: str, end: str):
    """The lines of `path` from the first line containing start through the next line equal to end."""
    lines = path.read_text(encoding="utf-8").split("\n")
    first = next((n for n, line in enumerate(lines) if start in line), None)
    if first is None:
        return None, f"no line contains the START marker {start!r}"
    last = next((n for n in range(first + 1, len(lines)) if lines[n].rstrip() == end), None)
    if last is None:
        return None, f"no line after line {first + 1} equals the END marker {end!r}"
    return lines[first:last + 1], None


def check(root: pathlib.Path):
    """Returns (number of snippets checked, list of problems)."""
    problems = []
    n = 0
    for doc in documents(root):
        for at, args, block, problem in snippets(doc, root):
            n += 1
            if problem:
                problems.append(f"{at}: {problem}")
                continue
            path, start, end = args
            source = root / path
            if not source.is_file():
                problems.append(f"{at}: {path} does not exist")
                continue
            want, problem = region(source, start, end)
            if problem:
                problems.append(f"{at}: {path}: {problem}")
                continue
            shown = [line.rstrip() for line in block]
            want = [line.rstrip() for line in want]
            if shown != want:
                diff = difflib.unified_diff(want, shown, fromfile=f"{path} ({start!r} .. {end!r})",
                                            tofile=f"{at} (the code block)", lineterm="")
                problems.append(f"{at}: the code block differs from {path}:\n" + "\n".join(diff))
    return n, problems


def self_test(root: pathlib.Path) -> int:
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp)
        quoted = set()
        for doc in documents(root):
            dst = copy / doc.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(doc, dst)
            for _, args, _, _ in snippets(doc, root):
                if args and (root / args[0]).is_file():
                    quoted.add(args[0])
        for path in quoted:
            (copy / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / path, copy / path)
        n, bad = check(copy)
        if bad or n == 0:
            print("check-doc-snippets self-test: the copy is not clean to start with"
                  + ("" if bad else " (no snippet comment found)"), *bad, sep="\n  ")
            return 1

        # The first snippet of the first document that has one.
        doc = next(d for d in documents(copy) if any(a for _, a, _, _ in snippets(d, copy)))
        original = doc.read_text(encoding="utf-8")
        lines = original.split("\n")
        comment = next(k for k, line in enumerate(lines) if COMMENT.match(line))
        rel = doc.relative_to(copy).as_posix()
        failures = []

        # 1. One line of the quoted block changed in the document.
        planted = lines[:]
        planted[comment + 2] += "  // planted difference"
        doc.write_text("\n".join(planted), encoding="utf-8")
        _, bad = check(copy)
        if not any(f"{rel}:{comment + 1}: the code block differs" in b and "planted difference" in b for b in bad):
            failures.append("a changed line in a quoted block was not reported with its diff")
        for b in bad:
            print("  found:", b.split("\n")[0])

        # 2. A START marker that no line contains.
        planted = lines[:]
        args = shlex.split(COMMENT.match(lines[comment]).group(1))
        planted[comment] = "<!-- snippet: {} {} {} -->".format(
            shlex.quote(args[0]), shlex.quote("no such START marker"), shlex.quote(args[2]))
        doc.write_text("\n".join(planted), encoding="utf-8")
        _, bad = check(copy)
        if not any("no line contains the START marker 'no such START marker'" in b for b in bad):
            failures.append("a START marker that no line contains was not reported")
        for b in bad:
            print("  found:", b.split("\n")[0])

        doc.write_text(original, encoding="utf-8")
        if failures:
            print("check-doc-snippets self-test: FAILED:", *failures, sep="\n  ")
            return 1
        print(f"check-doc-snippets self-test: passed ({n} snippet(s) in the copy; both planted problems found)")
        return 0


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] == "--self-test":
        return self_test(pathlib.Path(args[1] if len(args) > 1 else "."))
    root = pathlib.Path(args[0] if args else ".")
    n, bad = check(root)
    for b in bad:
        print(b)
    print(f"check-doc-snippets: {n} snippet(s), {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
