"""Corrupt metadata through every path, for ``compute-sanitizer --tool memcheck``.

``compute-sanitizer --tool memcheck python scripts/sanitize_corrupt.py`` must report no
error: block ids far outside the cache, negative ids, seq_lens past the block table and slots
past the cache are masked in the kernels, never dereferenced. Prints one line per case.
"""

import torch

from pagedattn import paged_attention, plan_attention, write_kv
from pagedattn.testing import make_paged_batch


def main():
    g = torch.Generator().manual_seed(0)
    corruptions = {
        "id-far": lambda b: b.block_table.__setitem__((1, 0), 2**30),
        "id-negative": lambda b: b.block_table.__setitem__((2, 1), -(2**20)),
        "len-past-table": lambda b: b.seq_lens.__setitem__(0, b.block_table.shape[1] * 16 + 5000),
        "qsl-past-end": lambda b: b.query_start_loc.__setitem__(3, 10**6),
    }
    for name, corrupt in corruptions.items():
        batch = make_paged_batch([(1, 300), (4, 40), (2, 90), (1, 17)], num_q_heads=8, num_kv_heads=2,
                                 head_size=64, dtype=torch.bfloat16, device="cuda", generator=g)
        corrupt(batch)
        for path, splits in (("unified", None), ("split_kv", 4), ("persistent", None)):
            plan = plan_attention([0, 1], [300], num_q_heads=8, num_kv_heads=2, head_size=64, device="cuda",
                                  path=path, num_splits=splits, max_num_tokens=batch.q.shape[0], max_num_seqs=4)
            if path == "persistent":  # its work list comes from the (corrupt) host metadata
                plan.update(batch.query_start_loc.cpu().clamp(max=batch.q.shape[0]), batch.seq_lens.cpu())
            paged_attention(*batch.args(), plan=plan)
            torch.cuda.synchronize()
            print(f"{name:16s} {path:10s} ran", flush=True)
    key = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    write_kv(key, key, k_cache, k_cache.clone(), torch.tensor([5, 2**40, -9, 64], device="cuda"))
    torch.cuda.synchronize()
    print("write_kv slots-out-of-range ran")


if __name__ == "__main__":
    main()
