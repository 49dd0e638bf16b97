"""Where a kernel's warps wait, per SASS instruction (perf/h200.sh stage `ncusrc`): from the CSV of ncu's source
page (`ncu -i REPORT --page source --csv --print-source sass`, collected with `--section SourceCounters`), the
instructions with the most warp-stall samples and the main loop's share: the span of the most executed
instructions among those whose execution count at least 100 share (a loop body; a spin-wait is a few).

    python perf/ncu_stalls.py ws_src.csv [--top 25]
"""
from __future__ import annotations

import argparse
import csv
from collections import Counter


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu's source page as CSV (one kernel)")
    ap.add_argument("--top", type=int, default=25, help="instructions to list")
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    col = {n: rows[1].index(n) for n in ("Address", "Source", "Warp Stall Sampling (All Samples)",
                                         "Instructions Executed")}  # row 0 names the kernel
    data = [r for r in rows[2:] if len(r) > max(col.values())]
    base = int(data[0][col["Address"]], 16)
    insts = [(int(r[col["Address"]], 16) - base, number(r[col["Warp Stall Sampling (All Samples)"]]),
              int(number(r[col["Instructions Executed"]])), r[col["Source"]].strip()) for r in data]
    total = sum(s for _, s, _, _ in insts)
    body = max(n for n, k in Counter(n for _, _, n, _ in insts if n > 0).items() if k >= 100)
    loop = [off for off, _, n, _ in insts if n == body]
    in_loop = sum(s for off, s, _, _ in insts if loop[0] <= off <= loop[-1])
    print(f"{len(insts)} instructions, {total:.0f} samples; the main loop ({loop[0]:#x}-{loop[-1]:#x}, its body "
          f"executed {body} times) holds {in_loop / total:.1%} of them\nshare   offset   executed  instruction")
    for off, s, n, src in sorted(insts, key=lambda t: -t[1])[:args.top]:
        print(f"{s / total:5.1%} {off:#8x} {n:10d}  {src[:80]}")


if __name__ == "__main__":
    main()
