"""How much CPU this machine's processes really get (issue 29; perf-notes, session 32): the affinity, the
cgroup's quota (``cpu.max``), and N processes each spinning for ``--seconds`` of wall time: the CPU seconds
each got. With a quota of Q CPUs, N > Q processes get about Q / N of a CPU each.

    python3 benchmarks/cpu_burn.py [--procs 1,2,4,8,16] [--seconds 1.5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path


def _spin(seconds: float, q) -> None:
    start, cpu0 = time.perf_counter(), time.process_time()
    x = 0
    while time.perf_counter() - start < seconds:
        x += 1
    q.put(time.process_time() - cpu0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--procs", default="1,2,4,8,16")
    p.add_argument("--seconds", type=float, default=1.5)
    args = p.parse_args()
    print("visible CPUs", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)))
    for f in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.weight"):
        if Path(f).exists():
            print(f, Path(f).read_text().strip())
    stat = Path("/sys/fs/cgroup/cpu.stat")
    before = stat.read_text() if stat.exists() else ""
    for n in (int(v) for v in args.procs.split(",")):
        q = mp.Queue()
        procs = [mp.Process(target=_spin, args=(args.seconds, q)) for _ in range(n)]
        for proc in procs:
            proc.start()
        cpu = [q.get() for _ in procs]
        for proc in procs:
            proc.join()
        print(
            f"{n:3d} procs: {sum(cpu):6.2f} CPU s in {args.seconds} s wall = {sum(cpu) / args.seconds:5.2f} CPUs "
            f"(min {min(cpu) / args.seconds:.2f} a process)",
            flush=True,
        )
    if before:
        print("cpu.stat before:", " ".join(before.split()))
        print("cpu.stat after: ", " ".join(stat.read_text().split()))


if __name__ == "__main__":
    main()
