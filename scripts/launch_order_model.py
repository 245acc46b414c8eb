"""Experiment 25 (docs/perf-notes.md): the causal prefill grid's finish time under list scheduling.

    python scripts/launch_order_model.py

Each program goes to the first free SM in launch order and runs for as many time units as it
has key tiles (Q tile i of a causal prefill reads i + 1). One program per SM (the prefill
kernel's shared memory), 132 SMs, 32 heads, 128-row tiles.
"""

import heapq


def finish_time(jobs, sms=132):
    free = [0] * sms
    end = 0
    for units in jobs:
        t = heapq.heappop(free) + units
        end = max(end, t)
        heapq.heappush(free, t)
    return end


for s in (2048, 8192, 32768):
    tiles, heads = s // 128, 32
    per_head = [(tiles - i) for h in range(heads) for i in range(tiles)]  # before: heaviest first per head
    longest = [(tiles - i) for i in range(tiles) for h in range(heads)]  # every head's heaviest first
    ideal = sum(per_head) / 132
    print(f"S={s}: ideal {ideal:.1f}, per-head order {finish_time(per_head)}, longest first {finish_time(longest)}")
