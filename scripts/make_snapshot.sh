#!/bin/bash
# Copy the pagedattn package of a commit into a git-ignored folder, for an A/B of two trees in
# one GPU run: `scripts/make_snapshot.sh <commit> .ab_prev`, carry `.ab_prev` to the GPU machine,
# and run the benchmark FROM INSIDE the folder (`scripts/gpu_run.sh --ab .ab_prev ...` does so):
# `python -m` puts the working directory first on sys.path, so PYTHONPATH=.ab_prev from the
# repository root would time the current tree twice.
set -euo pipefail
commit=$1; dir=$2
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
rm -rf "$dir" && mkdir -p "$dir" && git archive "$commit" pagedattn | tar x -C "$dir"
echo "$dir: pagedattn at $(git rev-parse --short "$commit")"
