"""Turns bench/run-ddp's CSV into the markdown table and the bar chart."""
import csv
import datetime
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODELS = [("mlp", "MLP 1024-2048-2048-2048-10 (10.5M)"),
          ("cnn", "MNIST CNN (1.2M)"),
          ("cnn_bn", "MNIST CNN + BatchNorm"),
          ("mlp_const", "MLP + constant 1024x1024 buffer")]
MODES = [("single", "1 process, no DDP"), ("manual", "hand-written all-reduce (Gloo)"),
         ("pytorch", "PyTorch DDP (Gloo)"), ("lockstep_gloo", "lockstep DDP, Gloo"),
         ("lockstep", "lockstep DDP, shared memory")]


def main():
    source, table, chart, iterations, rounds, breakdown = sys.argv[1:7]
    # The median over rounds: on this noisy machine the best round of one
    # side is sometimes faster than one process without DDP.
    rounds_of = {}
    for row in csv.DictReader(open(source)):
        key = (row["model"], row["mode"])
        rounds_of.setdefault(key, []).append((float(row["median_ms"]), float(row["peak_rss_mib"])))
    typical = {key: sorted(values)[(len(values) - 1) // 2] for key, values in rounds_of.items()}
    cores = os.cpu_count()
    import torch  # the peer's version, and LibTorch's under lockstep (one package)
    lines = [
        "# lockstep DDP vs PyTorch DDP",
        "",
        f"LibTorch and PyTorch {torch.__version__.split('+')[0]} (Debian's, both sides built on it).",
        f"2 ranks x 1 intra-op thread on one {cores}-core machine, OpenBLAS,",
        f"batch 64 per rank, SGD. Median ms per iteration (zero_grad + forward + loss + backward + step)",
        f"over {iterations} timed iterations after 10 of warm-up; the median of {rounds} alternating rounds;",
        f"peak RSS is the largest rank's. Measured {datetime.date.today()} by `bench/run-ddp`;",
        "default options on both sides (lockstep: 25 MiB buckets, gradients as bucket views,",
        "buffers broadcast when changed, shared memory between the ranks of one host, or Gloo",
        "with LOCKSTEP_TRANSPORT=gloo; PyTorch: 25 MiB buckets, broadcast_buffers=True, Gloo).",
        "Peak RSS counts the shared segment's pages that a rank touched, in every rank.",
        ("Both sides with glibc keeping the memory it frees (GLIBC_TUNABLES="
         f"{os.environ['GLIBC_TUNABLES']}, as the tests run)."
         if os.environ.get("GLIBC_TUNABLES") else
         "Both sides with glibc's default malloc settings (the program chooses; see docs/troubleshooting.md)."),
        "",
        "| model | " + " | ".join(label for _, label in MODES) +
        " | shm / PyTorch | shm / 1 process | Gloo / PyTorch |",
        "|---|" + "---:|" * (len(MODES) + 3),
    ]
    for model, label in MODELS:
        cells = []
        for mode, _ in MODES:
            ms, rss = typical.get((model, mode), (float("nan"), float("nan")))
            cells.append(f"{ms:.1f} ms, {rss:.0f} MiB")
        ms_of = lambda mode: typical.get((model, mode), (float("nan"),))[0]
        lines.append(f"| {label} | " + " | ".join(cells) +
                     f" | **{ms_of('lockstep') / ms_of('pytorch'):.2f}x**"
                     f" | {ms_of('lockstep') / ms_of('single'):.2f}x"
                     f" | {ms_of('lockstep_gloo') / ms_of('pytorch'):.2f}x |")
    lines += ["", f"![bar chart]({os.path.basename(chart)})", "",
              "The MNIST CNN + BatchNorm with lockstep's SyncBatchNorm instead (PyTorch 1.13 has",
              "none on CPU), and what a join guard costs: [bench-join-syncbn.md](bench-join-syncbn.md),",
              "by `bench/run-join-syncbn`.",
              "",
              "## What the diagnostics cost",
              "",
              "`LOCKSTEP_DEBUG=DETAIL` makes the ranks compare every collective in the job's ledger",
              "before running it (on one host a mapped file, across hosts the store), and wait for",
              "the slowest rank, at each bucket's launch. It is measured within one run that switches the comparison",
              "off and on every 5 iterations (`bench_ddp MODEL detail_ab`), so that the machine's",
              "drift cancels out. The timeline (`LOCKSTEP_TIMELINE`) is a separate run, beside",
              "the lockstep column above: recording a span takes about 0.6 us here (5 ns when",
              "off) and an iteration of these models records about 10, so the differences in its",
              "column are this machine's noise, not the recorder. Default lockstep keeps one ledger",
              "write per collective (what names missing ranks in a timeout), included",
              "in every lockstep figure.",
              "",
              "| model | lockstep (DETAIL off) | DETAIL on | DETAIL costs | lockstep | with timeline | timeline costs |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for model, label in MODELS:
        off = typical.get((model, "lockstep_ab"), (float("nan"),))[0]
        detail = typical.get((model, "lockstep_detail"), (float("nan"),))[0]
        base = typical.get((model, "lockstep"), (float("nan"),))[0]
        timeline = typical.get((model, "lockstep_timeline"), (float("nan"),))[0]
        lines.append(f"| {label} | {off:.1f} ms | {detail:.1f} ms | {detail - off:+.1f} ms "
                     f"({detail / off:.2f}x) | {base:.1f} ms | {timeline:.1f} ms | "
                     f"{timeline - base:+.1f} ms |")
    lines += ["",
              "## Where lockstep's time goes",
              "",
              "From `DdpStats` on rank 0, last round (mean per iteration):",
              ""]
    lines += [f"- {line.strip()}" for line in open(breakdown) if line.strip()]
    lines += ["",
              "Over shared memory the buckets live in the segment that the host's ranks share",
              "(`World::allocate`): backward writes the gradients there, each rank reduces its",
              "slice of every rank's bucket in place and writes the sum back into all of them,",
              "with no copy in or out and no socket. What is left of the wait is the slowest",
              "rank's backward (the ranks share two cores) and the reduction of the last bucket,",
              "which can only leave when backward ends: for the MLP's 20 MiB, about 2 to 3 ms of",
              "memory traffic here, against 20 to 25 ms over Gloo.",
              ""]
    open(table, "w").write("\n".join(lines))

    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.16
    for i, (mode, label) in enumerate(MODES):
        values = [typical.get((model, mode), (0,))[0] for model, _ in MODELS]
        ax.bar([m + (i - (len(MODES) - 1) / 2) * width for m in range(len(MODELS))], values,
               width, label=label)
    ax.set_xticks(range(len(MODELS)))
    ax.set_xticklabels([label for _, label in MODELS], fontsize=8)
    ax.set_ylabel("ms per iteration (lower is better)")
    ax.set_title("2 ranks, batch 64 per rank, 1 thread each")
    ax.legend(fontsize=8, loc="upper center", ncol=3, bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(chart, dpi=100)


if __name__ == "__main__":
    main()
