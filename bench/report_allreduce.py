"""Turns bench/run-allreduce's CSV into the markdown tables and the chart."""
import csv
import datetime
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = [("lockstep-shm-in-place", "lockstep shm, in place"),
         ("lockstep-shm", "lockstep shm, own tensor"),
         ("lockstep-gloo", "lockstep Gloo"),
         ("openmpi", "OpenMPI MPI_Allreduce"),
         ("torch-gloo", "torch.distributed gloo")]


def size_label(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main():
    source, table, chart, rounds = sys.argv[1:5]
    runs = {}
    for row in csv.DictReader(open(source)):
        key = (int(row["ranks"]), row["impl"], int(row["bytes"]))
        runs.setdefault(key, []).append(float(row["median_us"]))
    # The median over rounds.
    typical = {key: sorted(v)[(len(v) - 1) // 2] for key, v in runs.items()}
    sizes = sorted({key[2] for key in typical})
    lines = [
        "# All-reduce: shared memory, Gloo, OpenMPI, torch.distributed",
        "",
        f"float32 sum on one {os.cpu_count()}-core machine, 1 thread per rank: the median of up to",
        "200 timed calls (each after a barrier, its tensor rewritten before, as backward writes",
        f"a bucket), after 3 warm-up calls; the median of {rounds} alternating rounds. Measured",
        f"{datetime.date.today()} by `bench/run-allreduce`. lockstep shm *own tensor* is a tensor",
        "of the program's (copied in and out of the shared segment); *in place* is one from",
        "`World::allocate`, where DDP keeps its buckets. Bus bandwidth = bytes x 2(n-1)/n / time.",
        "",
    ]
    for ranks in (2, 4):
        lines += [f"## {ranks} ranks", "",
                  "| size | " + " | ".join(f"{label} (us)" for _, label in IMPLS) +
                  " | in place vs OpenMPI | in place busbw (GB/s) |",
                  "|---:|" + "---:|" * (len(IMPLS) + 2)]
        for nbytes in sizes:
            cells = [typical.get((ranks, impl, nbytes), float("nan")) for impl, _ in IMPLS]
            inplace, mpi = cells[0], cells[3]
            busbw = nbytes * 2 * (ranks - 1) / ranks / (inplace * 1e-6) / 1e9
            lines.append(f"| {size_label(nbytes)} | " + " | ".join(f"{c:.1f}" for c in cells) +
                         f" | {inplace / mpi:.2f}x | {busbw:.2f} |")
        lines.append("")
    lines += ["![all-reduce time by size](bench-allreduce.png)", ""]
    open(table, "w").write("\n".join(lines))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, ranks in zip(axes, (2, 4)):
        for impl, label in IMPLS:
            xs = [n for n in sizes if (ranks, impl, n) in typical]
            axis.loglog(xs, [typical[(ranks, impl, n)] for n in xs], marker="o", label=label)
        axis.set_title(f"{ranks} ranks, one host")
        axis.set_xlabel("message size (bytes)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median time per all-reduce (us)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(chart, dpi=110)


if __name__ == "__main__":
    main()
