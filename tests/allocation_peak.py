"""The peak of CPU memory a call allocates, for tests that compare it with a reference's."""

import torch


def peak_bytes(step) -> int:
    """The most bytes ``step()`` has allocated at once, above what was allocated before it: the
    CPU allocator's allocation and free events (the profiler's event tree), in order."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        e = pending.pop()
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
        pending.extend(e.children)
    live = peak = 0
    for _, size in sorted(events, key=lambda t: t[0]):
        live += size
        peak = max(peak, live)
    return peak
