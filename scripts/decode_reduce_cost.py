"""How much of a split-KV decode call the second kernel (the merge of the partials) costs.

Times ``paged_attention`` with the default plan, then the same with the merge launch replaced by
nothing (the output is then wrong; only the time is kept). GPU only:
``PYTHONPATH=. python scripts/decode_reduce_cost.py``.
"""

import torch

import pagedattn.ops.split_kv.launch as split_launch
from pagedattn.api import paged_attention
from pagedattn.bench.timing import bench
from pagedattn.bench.tune_decode import case_copies_and_plan
from pagedattn.bench.workloads import make_cases


class _Skip:
    def __getitem__(self, grid):
        return lambda **kwargs: None


def main():
    device = torch.device("cuda")
    real = split_launch.reduce_splits_kernel
    for case in make_cases(["decode"]):
        if case.name.split("decode ")[1] not in ("B=1 L=512", "B=1 L=4096", "B=1 L=32768", "B=8 L=512", "B=8 L=4096",
                                                 "B=32 L=512"):
            continue
        copies, plan = case_copies_and_plan(case, device)
        fns = [lambda x=x: paged_attention(*x.paged_args(), plan=plan, **x.paged_kwargs()) for x in copies]
        full = bench(fns, device)["time_us"]
        split_launch.reduce_splits_kernel = _Skip()
        try:
            alone = bench(fns, device)["time_us"]
        finally:
            split_launch.reduce_splits_kernel = real
        print(f"{case.name:22s} path={plan.path:8s} splits={plan.num_splits:3d} full {full:7.1f} us  "
              f"without the merge {alone:7.1f} us  merge share {full - alone:5.1f} us", flush=True)


if __name__ == "__main__":
    main()
