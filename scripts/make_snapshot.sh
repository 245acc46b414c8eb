#!/bin/bash
# Copy the pagedattn package of a commit into a git-ignored folder for a same-run A/B on the
# device: `scripts/make_snapshot.sh <commit> .exp_prev`, pass `.exp_prev` in the run's carry list,
# and run it FROM INSIDE the folder (`cd .exp_prev && PYTHONPATH=. python -m pagedattn.bench ...`):
# `python -m` puts the working directory first on sys.path, so PYTHONPATH=.exp_prev from the
# repository root would time the current tree (docs/perf-notes.md, experiment 13's correction).
set -euo pipefail
commit=$1; dir=$2
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
rm -rf "$dir" && mkdir -p "$dir" && git archive "$commit" pagedattn | tar x -C "$dir"
echo "$dir: pagedattn at $(git rev-parse --short "$commit")"
