"""Experiment 20 (docs/perf-notes.md): copies of the package whose paged prefill kernel drops one
piece of the paged tile work at a time, to find what makes paged prefill slower than contiguous.

    python scripts/make_prefill_variants.py      # writes .exp_v0 ... .exp_v4 (git-ignored)

Each copy is run from inside its folder (see scripts/make_snapshot.sh). v1, v2 and v4 are wrong
for block ids outside the cache (v4 for every block table but the identity): timing only.
"""

import pathlib
import shutil
import subprocess

KERNEL = "pagedattn/ops/prefill/kernel.py"
GATHER = "page = page_of_keys(pages, first_page, k_pos, PAGE_SIZE).to(tl.int64)"
IN_LOOP = ("page = tl.load(block_row_ptr + k_pos // PAGE_SIZE, mask=(k_pos >= 0) & "
           "(k_pos // PAGE_SIZE < max_blocks_per_seq), other=-1).to(tl.int64)")
IDENTITY = "page = (k_pos // PAGE_SIZE).to(tl.int64)"
SCORE_MASK = "            elif PAGED:\n                p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, tl.where(page_ok"
NO_SCORE_MASK = "            elif False:\n                p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, tl.where(page_ok"
LOAD_MASK = "elif MASKED or PAGED:"
NO_LOAD_MASK = "elif MASKED:"

NOMASK = [(SCORE_MASK, NO_SCORE_MASK), (LOAD_MASK, NO_LOAD_MASK)]
VARIANTS = {
    "v0": [],  # main
    "v1": NOMASK,  # mask-free middle tiles skip the page checks
    "v2": NOMASK + [(GATHER, IN_LOOP)],  # and read block ids per tile from memory instead of tl.gather
    "v3": [(GATHER, IN_LOOP)],  # block ids per tile from memory, checks kept (a correct candidate)
    "v4": NOMASK + [(GATHER, IDENTITY)],  # no block table at all: the floor of the address work
}

root = pathlib.Path(__file__).resolve().parent.parent
for name, edits in VARIANTS.items():
    out = root / f".exp_{name}"
    subprocess.run(["scripts/make_snapshot.sh", "HEAD", str(out.name)], cwd=root, check=True)
    shutil.rmtree(out / "pagedattn")
    shutil.copytree(root / "pagedattn", out / "pagedattn")
    src = (out / KERNEL).read_text()
    for old, new in edits:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    (out / KERNEL).write_text(src)
    print(name, len(edits), "edits")
