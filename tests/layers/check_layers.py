#!/usr/bin/env python3
"""Checks that dp's layers include each other only downwards (docs/architecture.md).

Every #include in src/ and include/dp/ is an edge between two layers; include/dp/X and
src/X are the same layer. An edge that LAYERS below does not allow fails the check,
printed as file:line and the edge. Also checked:
  - a public header (include/dp/) includes no CUDA, cuDNN, cuBLAS or NCCL header and no
    internal header of src/;
  - CUDA-family headers appear only in the layers that may use them (CUDA_LAYERS);
  - .cu/.cuh files live only in src/backend/cuda/;
  - every folder under src/ and include/dp/ belongs to a layer;
  - a header Meson generates from include/dp/X.h.in (dp/version.h) is checked, and
    included, as include/dp/X.h;
  - the table itself has no cycle, and docs/architecture.md's "Include edges" section
    holds the same table (print it with --table).

Usage: check_layers.py [--root DIR] [--table] [--self-test]
Exit status: 0 when every check passes, 1 otherwise. Python 3 standard library only.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# (layer, folders relative to src/ and include/dp/, layers it may include), bottom up.
# A file belongs to the layer with the longest folder that contains it; a layer may
# always include itself. Only direct edges count, so list every layer a layer's files
# include by name (an include of a lower layer's header is allowed only if listed).
LAYERS = [
    ("core", ["core", "version.h"], []),
    ("backend", ["backend"], ["core"]),
    ("backend/cpu", ["backend/cpu"], ["backend", "core"]),
    ("backend/cuda", ["backend/cuda"], ["backend", "core"]),
    ("backend/stub", ["backend/stub"], ["backend", "core"]),
    ("dist", ["dist"], ["core"]),
    ("tensor+autograd", ["tensor", "autograd"], ["backend", "core"]),
    ("nn", ["nn"], ["tensor+autograd", "backend", "core"]),
    ("optim", ["optim"], ["nn", "tensor+autograd", "backend", "core"]),
    ("comm", ["comm"], ["dist", "tensor+autograd", "core"]),
    ("comm/local", ["comm/local"], ["comm", "tensor+autograd", "backend", "core"]),
    ("comm/mpi", ["comm/mpi"], ["comm", "dist", "tensor+autograd", "core"]),
    ("comm/hier", ["comm/hier"], ["comm/local", "comm/mpi", "comm", "dist", "tensor+autograd", "backend", "core"]),
    ("comm/nccl", ["comm/nccl"],
     ["comm", "dist", "tensor+autograd", "backend/cuda", "backend", "core"]),
    ("data", ["data"], ["dist", "tensor+autograd", "core"]),
    ("io", ["io"], ["optim", "nn", "dist", "tensor+autograd", "core"]),
    ("parallel", ["parallel"], ["comm", "dist", "optim", "nn", "tensor+autograd", "backend", "core"]),
    ("dp.h", ["dp.h"],
     ["parallel", "io", "data", "comm", "dist", "optim", "nn", "tensor+autograd", "core"]),
]

# Layers whose sources may include CUDA, cuDNN, cuBLAS or NCCL headers.
CUDA_LAYERS = {"backend/cuda", "comm/nccl"}
# The one folder that holds .cu and .cuh files.
CU_FOLDER = "src/backend/cuda"

CUDA_HEADER = re.compile(
    r"^(cuda|cublas|cublasLt|cudnn|nccl|curand|cufft|cusparse|cusolver|nvrtc|nvToolsExt"
    r"|nvtx3|driver_types|vector_types|thrust|cub|nv)([_./]|$)")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]')
SOURCE_EXT = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")
# A public header written by Meson's configure_file into the build tree's include/dp/.
GENERATED_EXT = ".h.in"
DOC = "docs/architecture.md"
DOC_SECTION = "## Include edges"
HERE = "tests/layers/check_layers.py"


def render_table():
    """The table as markdown, as docs/architecture.md holds it."""
    lines = ["| layer | folders (src/X and include/dp/X) | may include |",
             "|---|---|---|"]
    for name, folders, allowed in LAYERS:
        cells = ", ".join("`%s`" % f for f in folders)
        lines.append("| %s | %s | %s |" % (name, cells, ", ".join(allowed) or "—"))
    return lines


def table_problems():
    """Unknown names and cycles in LAYERS."""
    names = [name for name, _, _ in LAYERS]
    problems = []
    for name, _, allowed in LAYERS:
        for a in allowed:
            if a not in names:
                problems.append("LAYERS: %s may include unknown layer %s" % (name, a))
    graph = {name: [a for a in allowed if a in names and a != name]
             for name, _, allowed in LAYERS}
    state = {}  # name -> 1 visiting, 2 done

    def visit(node, path):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                problems.append("LAYERS: cycle " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in names:
        if name not in state:
            visit(name, [name])
    return problems


def layer_of(rel):
    """Layer of a path relative to src/ or include/dp/ ('comm/local/x.h'), or None."""
    best, best_len = None, -1
    for name, folders, _ in LAYERS:
        for f in folders:
            if (rel == f or rel.startswith(f + "/")) and len(f) > best_len:
                best, best_len = name, len(f)
    return best


def allowed_of(layer):
    for name, _, allowed in LAYERS:
        if name == layer:
            return allowed
    return []


def strip_block_comments(text):
    """Blanks /* ... */ comments, keeping line numbers."""
    return re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def source_files(root):
    """(path relative to root, path relative to its layer root, is public) of every source."""
    for top, public in (("src", False), ("include/dp", True)):
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for fn in sorted(filenames):
                full = os.path.join(dirpath, fn)
                if fn.endswith(SOURCE_EXT):
                    yield (os.path.relpath(full, root), os.path.relpath(full, base), public)
                elif public and fn.endswith(GENERATED_EXT):
                    # Its layer is that of the header it becomes: version.h.in -> version.h.
                    yield (os.path.relpath(full, root), os.path.relpath(full, base)[:-3], public)


def resolve(root, target):
    """Layer-relative path of a quoted include, and whether it is public; None if not found."""
    if target.startswith("dp/") and (os.path.isfile(os.path.join(root, "include", target)) or
                                     os.path.isfile(os.path.join(root, "include", target + ".in"))):
        return target[len("dp/"):], True
    if os.path.isfile(os.path.join(root, "src", target)):
        return target, False
    return None


def check(root):
    """All problems found under root, as printable lines."""
    problems = table_problems()
    for path, rel, public in source_files(root):
        if path.endswith((".cu", ".cuh")) and not path.startswith(CU_FOLDER + "/"):
            problems.append("%s: a .cu/.cuh file outside %s/ (CUDA code lives only there)"
                            % (path, CU_FOLDER))
        layer = layer_of(rel)
        if layer is None:
            problems.append("%s: belongs to no layer; add its folder to LAYERS in %s and to "
                            "the table in %s" % (path, HERE, DOC))
            continue
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = strip_block_comments(f.read())
        for lineno, line in enumerate(text.split("\n"), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, target = m.group(1), m.group(2)
            where = "%s:%d" % (path, lineno)
            if kind == "<":
                if CUDA_HEADER.match(target):
                    if public:
                        problems.append("%s: public header includes <%s>; CUDA, cuDNN, cuBLAS "
                                        "and NCCL headers stay in %s" %
                                        (where, target, ", ".join(sorted(CUDA_LAYERS))))
                    elif layer not in CUDA_LAYERS:
                        problems.append("%s: %s includes <%s>; only %s may include CUDA, "
                                        "cuDNN, cuBLAS or NCCL headers" %
                                        (where, layer, target, ", ".join(sorted(CUDA_LAYERS))))
                continue
            found = resolve(root, target)
            if found is None:
                problems.append('%s: #include "%s" is not a file under include/ or src/; use '
                                'the full path ("dp/<layer>/x.h" or "<layer>/x.h")'
                                % (where, target))
                continue
            target_rel, target_public = found
            if public and not target_public:
                problems.append('%s: public header includes internal header "%s"; a public '
                                'header includes only dp/ headers' % (where, target))
            to = layer_of(target_rel)
            if to is None:
                continue  # reported where that file itself is checked
            if to != layer and to not in allowed_of(layer):
                problems.append('%s: %s -> %s (#include "%s") is not an allowed include edge; '
                                '%s may include: %s' % (where, layer, to, target, layer,
                                                        ", ".join(allowed_of(layer)) or "nothing"))
    problems += doc_problems(root)
    return problems


def doc_problems(root):
    path = os.path.join(root, DOC)
    if not os.path.isfile(path):
        return []  # a tree without the docs (e.g. the self-test's) checks only the code
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if DOC_SECTION not in lines:
        return ["%s: no '%s' section; add it with the table from %s --table"
                % (DOC, DOC_SECTION, HERE)]
    start = lines.index(DOC_SECTION)
    table = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            table.append(line.rstrip())
        elif table:
            break
    if table != render_table():
        return ["%s: the table of '%s' differs from LAYERS in %s; replace it with the "
                "output of %s --table" % (DOC, DOC_SECTION, HERE, HERE)]
    return []


def self_test():
    """Runs the checker on a small tree with known violations: the check can fail."""
    cases = {
        "src/core/bad.cpp": ('#include "backend/backend.h"\n',
                             "src/core/bad.cpp:1: core -> backend"),
        "src/comm/local/bad.cpp": ('\n#include "backend/cpu/cpu_backend.h"\n',
                                   "src/comm/local/bad.cpp:2: comm/local -> backend/cpu"),
        "src/tensor/bad.cpp": ('#include <cuda_runtime.h>\n',
                               "src/tensor/bad.cpp:1: tensor+autograd includes <cuda_runtime.h>"),
        "include/dp/nn/bad.h": ('#include <nccl.h>\n#include "backend/backend.h"\n',
                                "include/dp/nn/bad.h:1: public header includes <nccl.h>"),
        "include/dp/nn/bad2.h": ('#include "backend/backend.h"\n',
                                 'include/dp/nn/bad2.h:1: public header includes internal'),
        "src/nn/kernel.cu": ("", "src/nn/kernel.cu: a .cu/.cuh file outside"),
        "src/widgets/w.cpp": ("", "src/widgets/w.cpp: belongs to no layer"),
        "src/data/bad.cpp": ('#include "missing.h"\n', 'src/data/bad.cpp:1: #include "missing.h"'),
        "include/dp/core/gen_bad.h.in": ('#include "dp/nn/x.h"\n',
                                         "include/dp/core/gen_bad.h.in:1: core -> nn"),
    }
    fine = {
        "src/backend/backend.h": '#include "dp/core/device.h"\n',
        "src/backend/cpu/cpu_backend.h": '#include "backend/backend.h"\n',
        "include/dp/core/device.h": "// #include <cuda_runtime.h> in a comment is fine\n",
        "src/comm/nccl/ok.cpp": '#include <nccl.h>\n/*\n#include "parallel/x.h"\n*/\n',
        "include/dp/core/gen.h.in": "#define DP_GEN @VALUE@\n",
        "src/core/uses_gen.cpp": '#include "dp/core/gen.h"\n',
        "include/dp/nn/x.h": '#include "dp/core/gen.h"\n',
    }
    tmp = tempfile.mkdtemp(prefix="check_layers_")
    try:
        for rel, text in list(fine.items()) + [(k, v[0]) for k, v in cases.items()]:
            full = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--root", tmp],
                              capture_output=True, text=True, check=False)
        out = proc.stdout + proc.stderr
        failures = []
        if proc.returncode != 1:
            failures.append("expected exit status 1, got %d" % proc.returncode)
        for rel, (_, needle) in cases.items():
            if needle not in out:
                failures.append("not reported: %s" % needle)
        for rel in fine:
            if rel + ":" in out:
                failures.append("reported a correct file: %s" % rel)
        if failures:
            print("check_layers self-test FAILED:\n  " + "\n  ".join(failures))
            print("checker output:\n" + out)
            return 1
        print("check_layers self-test: %d planted violations reported, correct files passed"
              % len(cases))
        return 0
    finally:
        shutil.rmtree(tmp)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "..", ".."),
                    help="repository root (default: two folders above this script)")
    ap.add_argument("--table", action="store_true",
                    help="print the include-edge table for docs/architecture.md")
    ap.add_argument("--self-test", action="store_true",
                    help="check that planted violations in a scratch tree are reported")
    args = ap.parse_args()
    if args.table:
        print("\n".join(render_table()))
        return 0
    if args.self_test:
        return self_test()
    root = os.path.abspath(args.root)
    problems = check(root)
    if problems:
        print("\n".join(problems))
        print("\n%d layering problem(s); the allowed edges are LAYERS in %s "
              "(docs/architecture.md, 'Include edges')" % (len(problems), HERE))
        return 1
    count = sum(1 for _ in source_files(root))
    print("layers: %d files under src/ and include/dp/ include only along allowed edges"
          % count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
