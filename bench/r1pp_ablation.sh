#!/usr/bin/env bash
# R1-Searcher++ on the toy world: stage 1 once, then the full recipe, its three ablations (the
# paper's Table 2), plain REINFORCE++ with the EM reward, each from the same stage-1 model. About
# 10 minutes a run on one CPU core with another run on the second (4 Dec; stage 1: ~7 more).
# Rerunning continues where it stopped (--resume): finished runs are skipped, an interrupted stage 1
# samples only its missing batches, an interrupted run resumes from its last checkpoint.
#
#   bash bench/r1pp_ablation.sh        # writes runs/r1pp-{full,nogroup,nomem,neither,baseline,searchonly}
#   SEEDS="1 2" bash bench/r1pp_ablation.sh   # and then the five stage-2 runs again with each of
#                                             # those --seed values: runs/r1pp-{full,...,baseline}-sN
#
# r1pp-searchonly is R1-Searcher's setting rather than an ablation: plain REINFORCE++ with the EM
# reward from the toy warm start in the search-only protocol (no stage 1, no internal answers).
#
# Each run's test EM and retrieval calls per question (by question type) are in its
# metrics.jsonl (the last row's eval/ keys); bench/r1pp_table.py prints them as a table.
# Each run uses one thread (OMP_NUM_THREADS=1 unless set), as the recorded results were measured:
# another thread count moves float rounding, and over 60 steps the sampled tokens.
set -euo pipefail
if [ $# -gt 0 ]; then  # it takes no arguments: --help (or anything else) prints the header above
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit $([ "$1" = "-h" ] || [ "$1" = "--help" ]; echo $?)
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread a run, as bench/r1pp_results.md was measured
"$PYTHON" -m searchlite.r1pp stage1 --preset toy-r1pp-sft --resume
run() { name=$1; shift; echo "== $name"; "$PYTHON" train.py --preset toy-r1pp --out_dir "runs/r1pp-$name" --resume "$@"; }
run full
run nogroup --group_reward false
run nomem --mem_coef 0
run neither --group_reward false --mem_coef 0
run baseline --reward em --mem_coef 0
echo "== searchonly"; "$PYTHON" train.py --algo reinforce_pp --reward em --out_dir runs/r1pp-searchonly --resume
for s in ${SEEDS:-}; do
  run "full-s$s" --seed "$s"
  run "nogroup-s$s" --seed "$s" --group_reward false
  run "nomem-s$s" --seed "$s" --mem_coef 0
  run "neither-s$s" --seed "$s" --group_reward false --mem_coef 0
  run "baseline-s$s" --seed "$s" --reward em --mem_coef 0
done
extra=$(for s in ${SEEDS:-}; do echo runs/r1pp-{full,nogroup,nomem,neither,baseline}-s$s; done)
# the tables of bench/r1pp_results.md: EM / RC by type, which hops each run answered without their passage, and the fewest retrievals the test set allows
"$PYTHON" bench/r1pp_table.py --runs runs/r1pp-{full,nogroup,nomem,neither,baseline,searchonly} $extra
