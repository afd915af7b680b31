#!/usr/bin/env python3
"""Digests of kernel variants' PTX, to show that a change to kernels_cu/ leaves the
compiled code as it was (a comment, a rename, code under a preprocessor flag that is off):
same digests, same PTX, hence the same SASS from the same ptxas, and no speed to A/B. The
names NVRTC gives internal-linkage symbols hash the source, so they are normalized first.
No GPU needed.

    python3 tools/ptx_digest.py [--kernels DIR] [KEY ...] > digests.txt
    (default keys: two variants of each kind; --kernels: another tree's kernels_cu)

Compare two trees: run it in each (or with --kernels pointing at each), then diff.
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


def ptx_digest(variant):
    from cupy.cuda import nvrtc
    arch = variant.archs[-1].replace("sm_", "compute_")
    src = _compile.assembled_source(variant.source)
    prog = nvrtc.createProgram(src, variant.source, (), ())
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        nvrtc.compileProgram(prog, _compile.NVRTC_OPTIONS + (f"-arch={arch}",))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    return hashlib.sha256(normalized(ptx).encode()).hexdigest()[:16]


def normalized(ptx):
    """The PTX with its internal-linkage names made one: NVRTC names them
    _INTERNAL_<source hash>_<file>_<process id>, mangled with the name's length before
    it, so both the hash and the process id's digits (the length too) would differ from
    one run to the next."""
    return re.sub(r"\d*_INTERNAL_[0-9A-Za-z_]+?cufa", "_INTERNAL_cufa", ptx)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", help="a kernels_cu folder to compile instead of the package's")
    p.add_argument("keys", nargs="*")
    args = p.parse_args()
    if args.kernels:
        _compile.KERNEL_FILES = pathlib.Path(args.kernels)
    variants = {v.key: v for v in _compile.all_variants()}
    for key in args.keys or default_keys():
        print(key, ptx_digest(variants[key]), flush=True)


if __name__ == "__main__":
    main()
