#!/usr/bin/env python3
"""Where a kernel's warps wait: the SASS lines with the most stall samples in an ncu
report (collected with --section SourceCounters), with their share of all samples.

    ncu --section SourceCounters --section WarpStateStats -o rep ... python3 bench/profile/profile_one.py
    python3 bench/profile/ncu_stalls.py rep.ncu-rep [--top 30]
"""
import argparse
import csv
import io
import subprocess


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--save", help="also write the raw CSV here")
    args = parser.parse_args()
    text = subprocess.run(["ncu", "--import", args.report, "--page", "source", "--csv",
                           "--print-source", "sass"], capture_output=True, text=True).stdout
    if args.save:
        with open(args.save, "w") as f:
            f.write(text)
    table = [row for row in csv.reader(io.StringIO(text)) if row]
    head = next(i for i, row in enumerate(table) if any("Stall Sampling (All" in c for c in row))
    cols = table[head]
    rows = [dict(zip(cols, row)) for row in table[head + 1:] if len(row) == len(cols)]
    samples = next(c for c in cols if "Stall Sampling (All" in c)
    source = next((c for c in cols if c in ("Source", "Sass", "SASS")), cols[1])
    address = cols[0]

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} samples; columns: {cols[:12]}")
    for r in sorted(rows, key=lambda r: -num(r[samples]))[:args.top]:
        print(f"{100 * num(r[samples]) / total:5.1f}%  {r[address]:>8}  {r[source][:110]}")


if __name__ == "__main__":
    main()
