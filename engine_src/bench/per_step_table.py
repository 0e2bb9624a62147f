"""Prints one line per bundle and mode from `kdtree bench` reports: AR and the best-speed-up
DDTree budget, with the per-step counters (launches, kernels, copies, syncs, microseconds).

    python3 bench/per_step_table.py OUT_DIR MODE [MODE ...]   (reads OUT_DIR/bench_MODE.json)
"""
import json
import sys


def line(mode: str, name: str, bundle: dict) -> str:
    """One bundle's AR and best DDTree figures as a line of text."""
    ar = bundle["ar"]
    best = max(bundle["ddtree"], key=lambda t: t["speedup_over_ar"])
    s, a = ar["per_step"], best["per_step"]
    return (f"{mode:12} {name:10} AR {ar['tokens_per_second']:7.0f} tok/s {s['us']:6.1f} us/step {s['launches']:5.1f} launches "
            f"{s['kernels']:5.1f} kernels {s['copies']:4.1f} copies {s['syncs']:3.1f} syncs | DDTree B={best['budget']:2} "
            f"{best['tokens_per_second']:7.0f} tok/s x{best['speedup_over_ar']:.2f} accept {best['accept_mean']:.2f} "
            f"(accept/speedup {best['accept_mean'] / best['speedup_over_ar']:.2f}) {a['us']:6.1f} us/round "
            f"{a['launches']:5.1f} launches {a['kernels']:5.1f} kernels {a['copies']:4.1f} copies {a['syncs']:3.1f} syncs "
            f"equals_ar={all(t['equals_ar'] for t in bundle['ddtree'])}")


def main(out: str, modes: list) -> None:
    """Prints the table for every mode whose report exists (and says which do not)."""
    for mode in modes:
        try:
            report = json.load(open(f"{out}/bench_{mode}.json"))
        except (OSError, ValueError) as e:
            print(mode, "no report:", e)
            continue
        for name, bundle in report["bundles"].items():
            print(line(mode, name, bundle))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
