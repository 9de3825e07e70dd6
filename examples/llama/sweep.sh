#!/usr/bin/env bash
# The full quality sweep: every scheme of the registry on 2048 tokens of GPL-3 (or $1 tokens),
# writing examples/llama/results/{eval.json,eval.md,pareto.png}. Needs a Release build with
# examples (the README's first command makes one) and fetch_model.sh's model and venv.
#   bash examples/llama/sweep.sh [tokens] [build-dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
tokens="${1:-2048}"
build="${2:-build}"
cache="${KVC_CACHE_DIR:-$HOME/.cache/kvc}"
out=examples/llama/results
bash examples/llama/fetch_model.sh
cmake --build "$build" -j2 --target kvc-eval
mkdir -p "$out"
"$build/examples/llama/kvc-eval" --model "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --text /usr/share/common-licenses/GPL-3 --tokens "$tokens" --schemes all \
  --json "$out/eval.json" --markdown "$out/eval.md"
"$cache/venv/bin/python" examples/llama/plot_pareto.py "$out/eval.json" "$out/pareto.png"
echo "sweep: wrote $out/eval.json, $out/eval.md, $out/pareto.png"
