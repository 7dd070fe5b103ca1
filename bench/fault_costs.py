# Runs bench_fault (and fault_torch.py) with and without a rank killed at
# step KILL_AT, and writes what the failure cost each way: steps lost,
# seconds lost (the run's wall time less the same run's without the
# failure), and for lockstep::FaultTolerance the survivors' stall and the
# time from the kill to every rank stepping again. Called by
# bench/run-fault-tolerance.
#   fault_costs.py BUILD_DIR OUTPUT_MD STEPS KILL_AT CHECKPOINT_EVERY
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

build, output, steps, kill_at, every = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
run = os.path.join(build, "tools/lockstep-run/lockstep-run")
bench = os.path.join(build, "bench/bench_fault")
here = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
LINE = re.compile(r"rank (\d+) pid (\d+) step (\d+) wall ([0-9.]+) size (\d+)")


def commands(folder):
    return {
        "lockstep FaultTolerance (--restart rank)":
            [run, "--nproc-per-node", str(RANKS), "--restart", "rank", "--max-restarts", "1",
             "--", bench, "elastic", str(steps)],
        f"lockstep-run --restart all, checkpoint every {every} steps":
            [run, "--nproc-per-node", str(RANKS), "--max-restarts", "1", "--", bench,
             "checkpoint", str(steps), str(every), folder],
        f"torchrun --max_restarts 1, checkpoint every {every} steps":
            # Through the test suite's wrapper, which mends Debian's torchrun.
            ["/usr/bin/python3", os.path.join(here, "../tests/support/torchrun.py"),
             "--standalone",
             "--nproc_per_node", str(RANKS), "--max_restarts", "1",
             os.path.join(here, "fault_torch.py"), str(steps), str(every), folder],
    }


def one_run(argv, kill):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               text=True, start_new_session=True)
    lines, pids, killed_at, step_at_kill = [], {}, None, None
    for line in process.stdout:
        lines.append(line)
        found = re.search(r"rank (\d+) pid (\d+)", line)
        if found:
            pids[int(found.group(1))] = int(found.group(2))
        found = LINE.search(line)
        if kill and killed_at is None and found and int(found.group(3)) >= kill_at:
            step_at_kill = int(found.group(3))
            killed_at = time.time() * 1000
            killed_pid = pids[RANKS - 1]
            os.kill(killed_pid, signal.SIGKILL)
    process.wait()
    with open(os.path.join(tempfile.gettempdir(), "fault-costs.log"), "a") as log:
        log.write("".join(lines))
    return "".join(lines), time.time() - start, killed_at, step_at_kill, \
        killed_pid if kill else None


def costs(name):
    with tempfile.TemporaryDirectory() as folder:
        _, clean_seconds, _, _, _ = one_run(commands(folder)[name], kill=False)
    with tempfile.TemporaryDirectory() as folder:
        text, seconds, killed_at, step_at_kill, killed_pid = one_run(commands(folder)[name],
                                                                      kill=True)
    seen = [(int(r), int(p), int(s), float(w), int(n)) for r, p, s, w, n in LINE.findall(text)]
    steps_seen = [(r, s, w, n) for r, p, s, w, n in seen]
    rank0 = [(s, w, n) for r, s, w, n in steps_seen if r == 0]
    before = [w for s, w, n in rank0 if w < killed_at]
    gaps = [b - a for a, b in zip(before, before[1:])]
    step_ms = statistics.median(gaps) if gaps else 0
    again_all = [w for r, s, w, n in steps_seen if w > killed_at and n == RANKS and
                 any(r2 == RANKS - 1 and w2 > killed_at for r2, s2, w2, n2 in steps_seen)]
    resumed = re.search(r"^(?:\[\d+\] )?rank \d+ resumed at step (\d+)", text, re.M)
    dropped = re.search(r"^(?:\[\d+\] )?rank 0 dropped (\d+)", text, re.M)
    if resumed:
        lost = step_at_kill - int(resumed.group(1)) + 1
    else:
        lost = int(dropped.group(1)) if dropped else float("nan")
    walls = sorted(w for s, w, n in rank0)
    stall = (max(b - a for a, b in zip(walls, walls[1:])) - step_ms) / 1000
    # Every rank stepping again: the killed rank's first step after the kill.
    back = [w for r, p, s, w, n in seen if r == RANKS - 1 and p != killed_pid and w > killed_at]
    all_again = (back[0] - killed_at) / 1000 if back else float("nan")
    # The job past the step it had reached when the rank died.
    past = [w for r, s, w, n in steps_seen if w > killed_at and s > step_at_kill]
    past_failure = (past[0] - killed_at) / 1000 if past else float("nan")
    return {"name": name, "step_ms": step_ms, "lost": lost, "stall": stall,
            "all_again": all_again, "past": past_failure,
            "seconds_lost": seconds - clean_seconds,
            "ok": "step %d" % steps in text}


KEPT_BELOW = "<!-- written by other benches: kept -->"


def main():
    # What other benches wrote below this one's table stays (run-ft-scale).
    kept = ""
    if os.path.exists(output):
        text = open(output).read()
        at = text.find(KEPT_BELOW)
        kept = "\n" + text[at:] if at >= 0 else ""
    rows = []
    for name in commands(""):
        print(f"bench: {name}", file=sys.stderr)
        rows.append(costs(name))
    with open(output, "w") as out:
        out.write(
            "# What a failure costs\n\n"
            f"`bench/run-fault-tolerance`: the 10.5M MLP, {RANKS} ranks x 1 intra-op thread on "
            f"one host, batch 64 per rank, SGD, {steps} steps; rank {RANKS - 1} is killed "
            f"(SIGKILL) as the job reaches step {kill_at}. Each row runs the same job twice, "
            "without and with the kill: *seconds lost* is the difference of their wall times "
            "(start, restarts and redone steps included). *Survivors' stall*: the longest "
            "pause between two of rank 0's steps, less one step (a restart of every rank "
            "pauses rank 0 too, until the job is back). *Kill to all stepping*: from the kill to the killed rank's first "
            "step after it (restarted, with the state). *Kill to past the failed step*: "
            "from the kill to the job's first step beyond the one it had reached.\n\n"
            "| way | step (ms) | steps lost | survivors' stall (s) | kill to all stepping (s) "
            "| kill to past the failed step (s) | seconds lost | finished |\n"
            "|---|---|---|---|---|---|---|---|\n")
        for row in rows:
            out.write(f"| {row['name']} | {row['step_ms']:.0f} | {row['lost']} | "
                      f"{row['stall']:.2f} | {row['all_again']:.2f} | {row['past']:.2f} | "
                      f"{row['seconds_lost']:.1f} "
                      f"| {'yes' if row['ok'] else 'no'} |\n")
        out.write(kept)
    print(open(output).read())


main()
