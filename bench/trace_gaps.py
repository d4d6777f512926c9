"""Where the GPU waits for the host, from a Chrome trace of torch's profiler (``lf-llm bench --trace
FILE``, any bench's ``--trace``).

Prints the GPU's busy time against the span of the profiled steps, the largest idle gaps between
one GPU activity (kernel, copy, memset) and the next, and for each gap what the host was doing:
when it launched the next activity (late: the host had not reached it yet; early: the GPU was
waiting on something else, e.g. a stream wait), the host-side runtime calls that blocked
(synchronisations, synchronous copies) and the outermost torch ops that ran in the window.

    python3 bench/trace_gaps.py TRACE.json [--gaps 15] [--min-gap-us 50]
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def blocks_host(call: dict) -> bool:
    """A runtime call the host waits in: a synchronisation, a synchronous copy, or an asynchronous
    copy that took long enough to have waited (a pageable or device-to-host one)."""
    name = call["name"]
    return "Synchronize" in name or name == "cudaMemcpy" or (name.startswith("cudaMemcpyAsync") and call["dur"] > 100)


def load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def outermost(ops: list[dict]) -> list[dict]:
    """The ops not nested in another op of the same thread (sorted by start)."""
    ops = sorted(ops, key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    kept, end_by_thread = [], {}
    for op in ops:
        if op["ts"] >= end_by_thread.get(op["tid"], float("-inf")):
            kept.append(op)
            end_by_thread[op["tid"]] = op["ts"] + op["dur"]
    return sorted(kept, key=lambda e: e["ts"])


def overlapping(intervals: list[dict], starts: list[float], t0: float, t1: float) -> list[tuple[dict, float]]:
    """Each interval that overlaps [t0, t1], with the length of the overlap (``starts``: their sorted starts)."""
    found = []
    for e in intervals[max(0, bisect.bisect_left(starts, t0) - 64):bisect.bisect_right(starts, t1)]:
        overlap = min(t1, e["ts"] + e["dur"]) - max(t0, e["ts"])
        if overlap > 0:
            found.append((e, overlap))
    return found


def report(events: list[dict], n_gaps: int, min_gap_us: float) -> str:
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        return "no GPU activity in this trace (profiled without CUDA?)"
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    launch_of = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    ops = outermost([e for e in events if e.get("cat") == "cpu_op"])
    op_starts = [e["ts"] for e in ops]
    blocking = sorted((e for e in runtime if blocks_host(e)), key=lambda e: e["ts"])
    blocking_starts = [e["ts"] for e in blocking]

    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy, end = 0.0, gpu[0]["ts"]
    gaps = []
    for prev, nxt in zip(gpu, gpu[1:]):
        prev_end = prev["ts"] + prev["dur"]
        end = max(end, prev_end)
        if nxt["ts"] - end >= min_gap_us:
            gaps.append((nxt["ts"] - end, end, prev, nxt))
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    cur0, cur1 = intervals[0]
    for s, t in intervals[1:]:
        if s > cur1:
            busy += cur1 - cur0
            cur0, cur1 = s, t
        else:
            cur1 = max(cur1, t)
    busy += cur1 - cur0
    idle = sum(g[0] for g in gaps)
    lines = [f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), "
             f"{len(gaps)} idle gaps of >= {min_gap_us:.0f} us totalling {idle / 1e3:.2f} ms"]

    by_call: dict[str, list[float]] = defaultdict(list)
    for e in blocking:
        by_call[e["name"]].append(e["dur"])
    if by_call:
        lines.append("blocking runtime calls (count, total ms, longest ms):")
        for name, durs in sorted(by_call.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"  {len(durs):5d}  {sum(durs) / 1e3:8.2f}  {max(durs) / 1e3:7.2f}  {name}")

    lines.append(f"the {min(n_gaps, len(gaps))} largest gaps:")
    for dur, t0, prev, nxt in sorted(gaps, key=lambda g: -g[0])[:n_gaps]:
        t1 = t0 + dur
        launch = launch_of.get(nxt.get("args", {}).get("correlation"))
        when = ""
        if launch is not None:
            late = launch["ts"] - t0
            when = (f"launched {late / 1e3:.2f} ms after the GPU went idle" if late > 0
                    else f"launched {-late / 1e3:.2f} ms before the GPU went idle")
        lines.append(f"- {dur / 1e3:.2f} ms at +{(t0 - gpu[0]['ts']) / 1e3:.1f} ms: after {prev['name'][:60]!r}, "
                     f"before {nxt['name'][:60]!r} ({when})")
        for e, overlap in sorted(overlapping(blocking, blocking_starts, t0, t1), key=lambda x: -x[1])[:3]:
            lines.append(f"    blocked {overlap / 1e3:.2f} ms in {e['name']}")
        for e, overlap in sorted(overlapping(ops, op_starts, t0, t1), key=lambda x: -x[1])[:6]:
            lines.append(f"    host {overlap / 1e3:.2f} ms in {e['name'][:90]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--gaps", type=int, default=15, help="how many of the largest gaps to list")
    parser.add_argument("--min-gap-us", type=float, default=50.0, help="the shortest idle time counted as a gap")
    args = parser.parse_args()
    print(report(load(args.trace), args.gaps, args.min_gap_us))


if __name__ == "__main__":
    main()
