#!/usr/bin/env python3
"""Digests of kernel variants' PTX, to show that a change to kernels_cu/ leaves the
compiled code as it was (a comment, a rename, code under a preprocessor flag that is off):
same digests, same PTX, hence the same SASS from the same ptxas, and no speed to A/B. The
names NVRTC gives internal-linkage symbols hash the source, so they are normalized first.
No GPU needed.

    python3 tools/ptx_digest.py [--kernels DIR] [--bodies] [--as KEY=EXPR ...] [KEY ...]
    (default keys: two variants of each kind; --kernels: another tree's kernels_cu)

Compare two trees: run it in each (or with --kernels pointing at each), then diff.
Where the change also renamed a kernel or gave it a template flag (its mangled name
differs), --bodies digests the code alone: each function's body, its own name, label
numbers and the order functions are emitted in set aside, and no constant declarations
(static constexpr members the change added or renamed); --as KEY=EXPR compiles KEY by
another name expression, the old tree's (e.g. "cufa::decode_mla_kernel<1, true>" for
decode_mla_bf16_tma before its e4m3 flag).
"""
import argparse
import hashlib
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from cufa import _compile  # noqa: E402


def default_keys():
    """The first and last variant of each kernel kind (by key prefix), every arch family."""
    kinds = {}
    for v in _compile.all_variants():
        kinds.setdefault(v.key.split("_")[0] + "_" + v.source, []).append(v.key)
    return [k for keys in kinds.values() for k in sorted({keys[0], keys[-1]})]


def ptx_digest(variant, bodies=False, expression=None):
    from cupy.cuda import nvrtc
    arch = variant.archs[-1].replace("sm_", "compute_")
    src = _compile.assembled_source(variant.source)
    prog = nvrtc.createProgram(src, variant.source, (), ())
    try:
        nvrtc.addNameExpression(prog, expression or variant.name_expression)
        nvrtc.compileProgram(prog, _compile.NVRTC_OPTIONS + (f"-arch={arch}",))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    text = code_bodies(ptx) if bodies else normalized(ptx)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def normalized(ptx):
    """The PTX with its internal-linkage names made one: NVRTC names them
    _INTERNAL_<source hash>_<file>_<process id>, mangled with the name's length before
    it, so both the hash and the process id's digits (the length too) would differ from
    one run to the next."""
    return re.sub(r"\d*_INTERNAL_[0-9A-Za-z_]+?cufa", "_INTERNAL_cufa", ptx)


_FUNCTION_START = re.compile(r"^(\.visible |\.weak )?\.(func|entry)\b")


def code_bodies(ptx):
    """normalized(ptx)'s functions alone, as one text: each from its .func/.entry line to
    its closing brace, its own name (and those of the functions it calls) made one, its
    labels renumbered, its static shared variables by their own names, its parameters'
    byte sizes left out (a record with fields appended reads every old field at its old
    offset), sorted (the emission order moves with a template's instantiation)."""
    ptx = normalized(ptx)
    names = set()  # (a .func may declare its return value before its name)
    for line in ptx.splitlines():
        found = re.match(r"^(?:\.visible |\.weak )?\.(?:func|entry)\s*(?:\([^)]*\)\s*)?([\w$]+)", line)
        if found:
            names.add(found.group(1))
    functions, current, depth = [], None, 0
    for line in ptx.splitlines():
        if _FUNCTION_START.match(line):
            current, depth = [line], 0
        elif current is not None:
            current.append(line)
            # (inline asm blocks open and close braces of their own inside a body)
            depth += line.count("{") - line.count("}")
            if depth == 0 and line.strip() == "}":
                functions.append("\n".join(current))
                current = None
    text = []
    for body in functions:
        for name in sorted(names, key=len, reverse=True):
            body = body.replace(name, "FUNCTION")
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        # a function's static __shared__ variable, by its own name: its mangled name holds
        # the function's template arguments, which a new defaulted one changes
        body = re.sub(r"_ZZ\w*E(\d+[A-Za-z_]\w*)", r"STATIC_\1", body)
        # a params record grown at its end (fields appended) moves no offset the code reads
        text.append(re.sub(r"(FUNCTION_param_\d+)\[\d+\]", r"\1[]", body))
    return "\n".join(sorted(text))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", help="a kernels_cu folder to compile instead of the package's")
    p.add_argument("--bodies", action="store_true",
                   help="digest the functions' code alone (names, labels, order, constants aside)")
    p.add_argument("--as", dest="expressions", action="append", default=[], metavar="KEY=EXPR",
                   help="compile KEY by this name expression (the other tree's)")
    p.add_argument("keys", nargs="*")
    args = p.parse_args()
    if args.kernels:
        _compile.KERNEL_FILES = pathlib.Path(args.kernels)
    expressions = dict(e.split("=", 1) for e in args.expressions)
    variants = {v.key: v for v in _compile.all_variants()}
    for key in args.keys or default_keys():
        print(key, ptx_digest(variants[key], args.bodies, expressions.get(key)), flush=True)


if __name__ == "__main__":
    main()
