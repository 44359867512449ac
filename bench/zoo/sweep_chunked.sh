#!/bin/bash
# The zoo sweep in family chunks, for a shared machine: each chunk is one `python -m bench.zoo.sweep` run
# (under nice, each family × plan holding the flock $LOCK while it computes), started from a snapshot of this
# checkout's HEAD taken at the chunk's start, so fixes committed meanwhile apply to the later chunks and edits
# in progress never do. Results merge into bench/results/zoo.json (--resume: entries already there are kept).
#
#   PLANS=tp2_sp,pp2,dp2_zero3,tp2_bf16,3d FIRST="olmo2 phi3" bash bench/zoo/sweep_chunked.sh
#
# PLANS, SOURCES (hf), CHUNK (families per chunk, 4), LOCK (a flock file, default $TMPDIR/parc-zoo.lock: share it with other heavy jobs), FIRST (families swept first, e.g.
# one per attention / norm / MLP variant; then the rest in transformers' order). Families whose tiny config
# is UNBUILT in the results file are skipped (they fail in plain PyTorch under every plan), and so are families
# whose every case is in the results already (no interpreter started for a chunk that would run nothing). Then
# `python -m bench.zoo.sweep --docs --plans none` writes the table.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
PLANS=${PLANS:-tp2_sp,pp2,dp2_zero3,tp2_bf16,3d}
SOURCES=${SOURCES:-hf}
CHUNK=${CHUNK:-4}
LOCK=${LOCK:-${TMPDIR:-/tmp}/parc-zoo.lock}
FIRST=${FIRST:-}
SNAP=$(mktemp -d /tmp/zoo_snapshot_XXXX)
FAMS=$(cd "$ROOT" && "$PY" -c "
import json
from bench.zoo import families, plans, sweep
rows = sweep.load()['results']
unbuilt = {r['family'] for r in rows if r['status'] == 'UNBUILT'}
have = {sweep._key(r) for r in rows}
def done(f):  # every case of the family already in the results (--resume would skip it: no chunk for it)
    return all((f, p, s) in have for p in '$PLANS'.split(',')
               for s in ('$SOURCES'.split(',') if plans.PLANS[p].tp else ['-']))
print(' '.join(dict.fromkeys(f for f in '''$FIRST'''.split() + list(families.families())
                             if f not in unbuilt and not done(f))))")
set -- $FAMS
while [ $# -gt 0 ]; do
  chunk=$(echo "${@:1:$CHUNK}" | tr ' ' ','); shift $(( $# < CHUNK ? $# : CHUNK ))
  rm -rf "$SNAP" && mkdir -p "$SNAP" && git -C "$ROOT" archive HEAD | tar -x -C "$SNAP"
  # pyproject maps parc.passes, parc.runtime and parc.grammar to top-level folders, and the editable install's
  # finder (on sys.meta_path, after PYTHONPATH) maps them to $ROOT's files, edits in progress included. Links
  # in the snapshot's parc/ let PYTHONPATH find the snapshot's own before that finder is asked.
  for sub in passes runtime grammar; do ln -s "../$sub" "$SNAP/parc/$sub"; done
  echo "=== chunk $chunk at $(git -C "$ROOT" rev-parse --short HEAD) $(date -u +%T)"
  (cd "$SNAP" && OMP_NUM_THREADS=1 PYTHONPATH="$SNAP" nice -n 10 "$PY" -m bench.zoo.sweep --plans "$PLANS" \
     --sources "$SOURCES" --families "$chunk" --lock "$LOCK" --resume --out "$ROOT/bench/results/zoo.json")
done
rm -rf "$SNAP"
echo "=== done $(date -u +%T)"
