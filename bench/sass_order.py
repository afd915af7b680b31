#!/usr/bin/env python3
"""Where a kernel variant's waits, products and exponentials sit in its SASS, without a GPU:
the variant's source compiled by nvcc -cubin for sm_90a (NVRTC's cubins did not load in
nvdisasm 13.5), disassembled by nvdisasm ($NVDISASM, else on PATH; the pip wheel
nvidia-cuda-nvdisasm has one), and the runs of HGMMA / WARPGROUP.DEPBAR / MUFU.EX2 /
named-barrier / shared-store instructions listed in program order. ptxas moves waits
across independent work (NOTES.md steps 3, 27, 44): this shows where they ended up.

    python3 bench/sass_order.py "family='sm90', dtype='fp16', head_dim=128, mask='none', score_mods=False, block_m=128" [--tree DIR] [--keep OUT.sass]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MARKS = re.compile(r"\b(HGMMA|WARPGROUP\.DEPBAR|WARPGROUP\.ARRIVE|MUFU\.EX2|BAR\.SYNC|BAR\.ARV|"
                   r"STS|SYNCS\.ARRIVE|SYNCS\.PHASECHK)\S*")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variant", help="a substring of the variant's repr (the first match is taken)")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                        help="checkout whose kernels_cu/ to compile")
    parser.add_argument("--keep", help="also write the whole SASS here")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    from cufa import _compile
    _compile.KERNEL_FILES = Path(args.tree) / "kernels_cu"
    _compile._source_cache.clear()
    variant = next((v for v in _compile.all_variants() if args.variant in repr(v)), None)
    if variant is None:
        sys.exit(f"no variant matches {args.variant!r}")
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        sys.exit("nvdisasm not found: set NVDISASM (pip download nvidia-cuda-nvdisasm, unzip)")
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "variant.cu")
        # a reference to the kernel instantiates the template, as NVRTC's name expression does
        source.write_text(_compile.assembled_source(variant.source) +
                          f"\n__device__ void* cufa_instance = (void*)&{variant.name_expression};\n")
        cubin = Path(tmp, "variant.cubin")
        built = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", *_compile.NVRTC_OPTIONS, "-o",
                                str(cubin), str(source)], capture_output=True, text=True)
        if built.returncode:
            sys.exit(built.stderr)
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    if args.keep:
        Path(args.keep).write_text(sass)
    print(variant)
    runs = []  # [first line, count, mnemonic]
    for number, line in enumerate(sass.splitlines(), 1):
        mark = MARKS.search(line)
        if not mark:
            continue
        name = mark.group(0)
        if runs and runs[-1][2] == name:
            runs[-1][1] += 1
        else:
            runs.append([number, 1, name])
    for number, count, name in runs:
        print(f"{number:6d}  {count:3d} x {name}")


if __name__ == "__main__":
    main()
