"""Which tiles the prefill autotuner picks: ``PAGEDATTN_AUTOTUNE=1 PYTHONPATH=. python scripts/tune_choices.py``.

Causal prefills of one sequence (S tokens, Llama-3 8B heads, bf16, 16-token pages) through a plan,
one call each; prints the remembered choice of every key (``chosen_tiles``) and the table's tiles.
"""

import torch

from pagedattn import paged_attention, plan_attention
from pagedattn.ops.prefill.tuning import chosen_tiles
from pagedattn.testing import make_paged_batch


def main():
    g = torch.Generator().manual_seed(0)
    for s in (512, 2048, 8192):
        batch = make_paged_batch([(s, s)], num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                                 dtype=torch.bfloat16, device="cuda", generator=g)
        plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8,
                              head_size=128, device="cuda", dtype=torch.bfloat16)
        paged_attention(*batch.args(), plan=plan)
        torch.cuda.synchronize()
    for key, tiles in chosen_tiles().items():
        print(key, "->", tiles)


if __name__ == "__main__":
    main()
