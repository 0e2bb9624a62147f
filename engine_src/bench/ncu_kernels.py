"""Sums Nsight Compute kernel durations per kernel (name and grid) over a window of a decode
run, per decode step: which kernels a step's GPU time goes to, and which grow with the rows.

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \\
        --print-kernel-base function \\
        --launch-skip S --launch-count C build/kdtree generate ... > run.csv
    python3 bench/ncu_kernels.py run.csv MARKER [TOP]

MARKER is a kernel name that runs once per step (AR: argmax_kernel; a DDTree round:
tree_accept_kernel, tree_walk_kernel before issue 21's fifth pass): the window's steps are its count. Prints the TOP (default 25) rows by time.
"""
import csv
import sys
from collections import defaultdict


def rows(path: str) -> list:
    """The CSV rows of an ncu --csv report (the program's own output lines skipped)."""
    with open(path, errors="replace") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    return list(csv.DictReader(lines))


def short(name: str) -> str:
    """A kernel name without its template arguments and parameter list."""
    name = name.replace("(anonymous namespace)::", "").replace("void ", "")
    return name.split("(")[0].split("<")[0].split("::")[-1].strip()[:48]


def main(path: str, marker: str, top: int) -> None:
    """Prints us per step for each (kernel, grid) and the step's total."""
    total = defaultdict(float)
    count = defaultdict(int)
    steps = 0
    for r in rows(path):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = short(r["Kernel Name"])
        key = (name, r.get("Grid Size", "?"))
        total[key] += float(r["Metric Value"].replace(",", "")) / 1000.0  # ns -> us
        count[key] += 1
        steps += name == marker
    if not steps:
        print(f"{path}: no {marker} in the window")
        return
    print(f"{path}: {steps} steps, {sum(count.values()) / steps:.1f} kernels and "
          f"{sum(total.values()) / steps:.1f} us of kernel time per step")
    for key, t in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t / steps:8.2f} us/step  {count[key] / steps:5.1f} x  {key[0]:48} grid {key[1]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 25)
