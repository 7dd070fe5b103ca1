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
         ("lockstep_adam_zero_slices", "lockstep, ZeRO in equal slices + step()"),
         ("lockstep_adam_zero_slices_in_backward", "lockstep, ZeRO in equal slices stepping in backward"),
         ("single_adam", "1 process, no DDP (batch 64)")]


NOTES = """
## Reading the table

- Each ZeRO rank runs Adam over half of the elements. That half saved is
  worth more than the broadcast of the new parameters, which moves 21 MiB
  per rank through shared memory.
- Stepping inside backward saves most where each bucket's step holds the
  averages in cache. Stepping ZeRO's equal slices in backward is the fastest
  way here.
- Adam's step allocates temporaries the size of each parameter. With
  glibc's defaults, they go back to the kernel after every parameter and
  fault in again at the next step, which costs about 25 ms per iteration
  here, PyTorch's as much as lockstep's.
- The second half of the table runs every row with glibc keeping freed
  memory, set by environment variables (`MALLOC_TRIM_THRESHOLD_`,
  `MALLOC_MMAP_THRESHOLD_`). That makes the step cheaper, so sharding and
  stepping in backward have less to save. lockstep does not change the
  process's allocator; a job that steps Adam on the CPU can.
- With PyTorch's partition, by whole parameters, the 10.5M MLP cannot be
  divided evenly: its tensors hold 4M, 4M and 2M elements. Equal slices
  (`ZeroPartition::Elements`) give every rank 1/N of the state.
"""


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
        "| ranks | plain Adam | ZeRO by parameters | ratio | ZeRO in equal slices | ratio | 1/N |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, n in [("state", 2), ("state4", 4)]:
        plain = state.get((kind, "lockstep_adam"))
        zero = state.get((kind, "lockstep_adam_zero"))
        slices = state.get((kind, "lockstep_adam_zero_slices"))
        if plain and zero and slices:
            lines.append(f"| {n} | {plain / 2**20:.1f} MiB | {zero / 2**20:.1f} MiB | {zero / plain:.2f} "
                         f"| {slices / 2**20:.1f} MiB | {slices / plain:.2f} | {1 / n:.2f} |")
    open(table, "w").write("\n".join(lines) + "\n" + NOTES)


if __name__ == "__main__":
    main()
