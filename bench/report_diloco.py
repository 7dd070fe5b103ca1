"""Writes docs/bench-diloco.md and .png from bench/run-diloco's measurements.

    report_diloco.py RESULTS WIRE MNIST LOSS_DIR OUT_MD OUT_PNG ITERATIONS EPOCHS
"""
import datetime
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results, wire_file, mnist_file, loss_dir, out, png, iterations, epochs = sys.argv[1:]

ms, order = {}, []
for line in open(results).readlines()[1:]:
    setting, mode, value, _ = line.strip().split(",")
    if setting not in order:
        order.append(setting)
    ms[(setting, mode)] = None if value == "failed" else float(value)
# Bytes per step do not depend on the link: by layout (2x1, 2x2) and mode.
wire = {}
for line in open(wire_file):
    setting, mode, count = line.strip().split(",")
    wire[(setting.split()[-1], mode)] = float(count)
alone = ms.get(("alone", "single"))


def label(mode):
    if mode == "pytorch":
        return "PyTorch 1.13 DDP (every step across)"
    if mode == "apart":
        return "replicas apart (H = 0, the link unused)"
    found = re.match(r"diloco_h(\d+)_f(\d+)_d(\d+)_?(\w*)", mode)
    h, f, d, w = found.groups()
    return f"DiLoCo H = {h}, {f} fragment{'s' if f != '1' else ''}, delay {d}, " + (
        w or "float32"
    )


lines = [
    "# DiLoCo across slow links",
    "",
    f"`bench/run-diloco {iterations} {epochs}`, {datetime.date.today()}: two hosts "
    "played by network namespaces on this 2-core machine (`bench/run-hosts`' link, "
    "limited by tbf). The MLP 10.5M, batch 64 per rank, plain SGD inside, the outer "
    "SGD of the paper (lr 0.7, Nesterov momentum 0.9). DiLoCo's time is the mean per "
    f"inner step over {iterations} steps after 100 of warm-up (a synchronisation costs "
    "one step in H); PyTorch's, the median of 4. \"× apart\" is against the same ranks "
    "training with the link unused (each host alone, beside the other: on this "
    "machine both hosts share its 2 cores); \"× alone\" against one process alone "
    + (f"({alone:.1f} ms)." if alone else "(not measured)."),
    "",
]
for setting in order:
    if setting == "alone":
        continue
    base = ms.get((setting, "apart"))
    torch = ms.get((setting, "pytorch"))
    lines += [f"## {setting}", "",
              "| configuration | ms per step | × apart | × alone | × PyTorch DDP | wire MB per step |",
              "|---|---|---|---|---|---|"]
    for (s, mode), value in ms.items():
        if s != setting:
            continue
        if value is None:
            lines.append(f"| {label(mode)} | failed | | | | |")
            continue
        ratio = lambda other: f"{value / other:.2f}" if other else ""  # noqa: E731
        sent = wire.get((s.split()[-1], mode))
        lines.append(
            f"| {label(mode)} | {value:.1f} | {ratio(base)} | {ratio(alone)} | "
            f"{ratio(torch)} | {sent / 1e6:.2f} |" if sent is not None else
            f"| {label(mode)} | {value:.1f} | {ratio(base)} | {ratio(alone)} | {ratio(torch)} | |")
    lines.append("")

runs = []
for line in open(mnist_file):
    name, rest = line.strip().split(",", 1)
    accuracy = re.search(r"final test accuracy ([0-9.]+)%", rest)
    wall = re.search(r"wall time ([0-9.]+) s", rest)
    runs.append((name, accuracy.group(1) if accuracy else "failed",
                 wall.group(1) if wall else ""))
names = {
    "ddp": "DDP, every step",
    "diloco20": "DiLoCo, H = 20",
    "diloco100": "DiLoCo, H = 100",
    "diloco100_f4": "Streaming DiLoCo, H = 100, 4 fragments, delay 5",
    "localsgd20": "LocalSGD, H = 20",
}
if runs:
    lines += ["## Quality: MNIST", "",
              f"2 ranks on one host (each a replica), {epochs} epochs of the CNN of "
              "`mnist_train`, batch 64 per rank, SGD (lr 0.02, momentum 0.9) inside: the "
              "same samples for every row. The test accuracy is of the replicas' mean. "
              f"Rank 0's loss is in [{os.path.basename(png)}]({os.path.basename(png)}).", "",
              "| training | test accuracy |", "|---|---|"]
    for name, accuracy, _ in runs:
        lines.append(f"| {names.get(name, name)} | {accuracy}% |")
    lines.append("")
    plt.figure(figsize=(8, 4.5))
    for name, _, _ in runs:
        path = os.path.join(loss_dir, "loss-" + name)
        if not os.path.exists(path):
            continue
        steps, losses = [], []
        for row in open(path):
            step, loss = row.split()
            steps.append(int(step))
            losses.append(float(loss))
        window = 25
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        plt.plot(steps, smooth, label=names.get(name, name), linewidth=1)
    plt.yscale("log")
    plt.xlabel("step (batch 64 per rank, 2 ranks)")
    plt.ylabel("rank 0's training loss (mean of 25 steps)")
    plt.title("MNIST: DDP, DiLoCo and LocalSGD")
    plt.legend()
    plt.tight_layout()
    plt.savefig(png, dpi=100)
open(out, "w").write("\n".join(lines) + "\n")
