"""Turns bench/run-optimizer's CSV into docs/bench-optimizer.md."""
import csv
import datetime
import sys

MODES = [("pytorch_adam", "PyTorch DDP + Adam"),
         ("pytorch_adam_zero", "PyTorch DDP + ZeroRedundancyOptimizer(Adam)"),
         ("lockstep_adam", "lockstep DDP + optimizer.step()"),
         ("lockstep_adam_in_backward", "lockstep, ddp.step_in_backward(adam)"),
         ("lockstep_adam_zero", "lockstep, ZeroRedundancyOptimizer<Adam> + step()"),
         ("lockstep_adam_zero_in_backward", "lockstep, ZeRO stepping in backward"),
         ("single_adam", "1 process, no DDP (batch 64)")]


def main():
    source, states, table, iterations, rounds = sys.argv[1:6]
    rounds_of = {}
    for row in csv.DictReader(open(source)):
        key = (row["setting"], row["mode"])
        rounds_of.setdefault(key, []).append((float(row["median_ms"]), float(row["peak_rss_mib"])))
    typical = {key: sorted(values)[(len(values) - 1) // 2] for key, values in rounds_of.items()}
    state = {}
    for line in open(states):
        fields = line.strip().split(",")
        if len(fields) == 4 and fields[0] in ("state", "state4"):
            state[(fields[0], fields[2])] = float(fields[3])
    import torch
    lines = [
        "# The optimizer inside the reduction",
        "",
        f"LibTorch and PyTorch {torch.__version__.split('+')[0]}. The 10.5M MLP with Adam (lr 1e-4), 2 ranks x 1",
        "intra-op thread on one 2-core machine (lockstep over shared memory, PyTorch over Gloo),",
        f"batch 64 per rank. Median ms per iteration (zero_grad + forward + loss + backward + step) over",
        f"{iterations} timed iterations after 10 of warm-up; the median of {rounds} alternating rounds;",
        f"peak RSS is the largest rank's. Measured {datetime.date.today()} by `bench/run-optimizer`.",
        "",
        "| | ms | vs PyTorch DDP + Adam | vs lockstep + step() | peak RSS MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for setting, title in [("default", "glibc's defaults"),
                           ("tuned", "glibc keeping freed memory (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ = 1 GiB)")]:
        lines.append(f"| **{title}** | | | | |")
        pytorch = typical.get((setting, "pytorch_adam"), (float("nan"), 0))[0]
        plain = typical.get((setting, "lockstep_adam"), (float("nan"), 0))[0]
        for mode, label in MODES:
            if (setting, mode) not in typical:
                continue
            ms, rss = typical[(setting, mode)]
            lines.append(f"| {label} | {ms:.1f} | {ms / pytorch:.2f}x | {ms / plain:.2f}x | {rss:.0f} |")
    lines += [
        "",
        "Adam's state per rank, as the optimizer saves it (bytes on the rank that holds the most):",
        "",
        "| ranks | plain Adam | ZeroRedundancyOptimizer<Adam> | ratio | 1/N |",
        "|---:|---:|---:|---:|---:|",
    ]
    for kind, n in [("state", 2), ("state4", 4)]:
        plain = state.get((kind, "lockstep_adam"))
        zero = state.get((kind, "lockstep_adam_zero"))
        if plain and zero:
            lines.append(f"| {n} | {plain / 2**20:.1f} MiB | {zero / 2**20:.1f} MiB | {zero / plain:.2f} | {1 / n:.2f} |")
    open(table, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
