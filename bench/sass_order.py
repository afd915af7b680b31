#!/usr/bin/env python3
"""Where a kernel variant's waits, products and exponentials sit in its SASS, without a GPU:
the variant's source compiled by nvcc -cubin for sm_90a (NVRTC's cubins did not load in
nvdisasm 13.5), disassembled by nvdisasm ($NVDISASM, else on PATH; the pip wheel
nvidia-cuda-nvdisasm has one), and the runs of HGMMA / WARPGROUP.DEPBAR / MUFU.EX2 /
named-barrier / shared-store instructions listed in program order. ptxas moves waits
across independent work (NOTES.md steps 3, 27, 44): this shows where they ended up.

With --loops, each loop that issues wgmma or exponentials instead: its instructions and the
cycles ptxas's schedule makes one warp wait between them (the stall count of each
instruction's control code, bits 105-108 of its 128-bit word), by opcode. That is the
loop's issue time for a warp whose every variable-latency result (MUFU, shuffles, loads,
wgmma) is ready when asked for: a floor, static, per warp. It counts every instruction in
the loop's address range, blocks that most iterations branch over included (the partial
key block's mask in the d = 128 loop: ~130 instructions, ~270 cycles of its 645 / 1462).

    python3 bench/sass_order.py "family='sm90', dtype='fp16', head_dim=128, mask='none', score_mods=False, block_m=128" [--tree DIR] [--keep OUT.sass] [--loops]
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
    parser.add_argument("--loops", action="store_true",
                        help="each wgmma or exponential loop's static stall cycles, by opcode")
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
        sass = subprocess.run([nvdisasm, "-c", *(["-hex"] if args.loops else []), str(cubin)],
                              check=True, capture_output=True, text=True).stdout
    if args.keep:
        Path(args.keep).write_text(sass)
    print(variant)
    if args.loops:
        print_loops(sass)
        return
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


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/")
HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
LABEL = re.compile(r"^\s*\.L_x_(\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\(\.L_x_(\d+)\)")


def print_loops(sass):
    """Loops (a branch back to a label above it) holding HGMMA or MUFU.EX2, innermost
    first: instructions, static stall cycles, the opcodes that hold the most cycles."""
    code, labels, pending = [], {}, []  # code: (address, text, stall cycles)
    lines = sass.splitlines()
    for number, line in enumerate(lines):
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.search(line)
        if not found:
            continue
        high = HIGH_WORD.match(lines[number + 1]) if number + 1 < len(lines) else None
        stall = (int(high.group(1), 16) >> 41) & 0xF if high else 0
        for name in pending:
            labels[name] = len(code)
        pending = []
        code.append((int(found.group(1), 16), found.group(2), stall))
    loops = []
    for end, (_, text, _) in enumerate(code):
        target = BRANCH.search(text)
        if target and labels.get(target.group(1), end) < end:
            body = code[labels[target.group(1)]:end + 1]
            if any("HGMMA" in t or "MUFU.EX2" in t for _, t, _ in body):
                loops.append(body)
    for body in sorted(loops, key=len):
        cycles, count = {}, {}
        for _, text, stall in body:
            words = text.split()
            op = words[1] if words[0].startswith("@") else words[0]
            cycles[op] = cycles.get(op, 0) + stall
            count[op] = count.get(op, 0) + 1
        top = sorted(cycles, key=cycles.get, reverse=True)[:10]
        print(f"loop {body[0][0]:#06x}-{body[-1][0]:#06x}: {len(body)} instructions, "
              f"{sum(s for _, _, s in body)} stall cycles; HGMMA {sum('HGMMA' in t for _, t, _ in body)}, "
              f"MUFU.EX2 {sum('MUFU.EX2' in t for _, t, _ in body)}")
        print("   " + ", ".join(f"{op} {count[op]}/{cycles[op]}" for op in top))


if __name__ == "__main__":
    main()
