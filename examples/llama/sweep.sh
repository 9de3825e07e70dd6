#!/usr/bin/env bash
# The full quality sweep: every scheme of the registry on 2048 tokens of GPL-3 (or $1 tokens),
# writing examples/llama/results/{eval.json,eval.md,pareto.png}. Needs a Release build with
# examples (the README's first command makes one) and fetch_model.sh's model and venv.
#   bash examples/llama/sweep.sh [tokens] [build-dir]
# KVC_ATTENTION=fast|exact|reference (optional) is passed to kvc-eval --attention; any mode but the
# default fast writes results/{eval,pareto}-<mode>.* instead, leaving the fast results alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
tokens="${1:-2048}"
build="${2:-build}"
cache="${KVC_CACHE_DIR:-$HOME/.cache/kvc}"
out=examples/llama/results
attention="${KVC_ATTENTION:-fast}"
case "$attention" in
  fast) suffix="" ;;
  exact|reference) suffix="-$attention" ;;
  *) echo "sweep: KVC_ATTENTION must be fast, exact or reference, got '$attention'" >&2; exit 2 ;;
esac
bash examples/llama/fetch_model.sh
cmake --build "$build" -j2 --target kvc-eval
mkdir -p "$out"
"$build/examples/llama/kvc-eval" --model "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --text /usr/share/common-licenses/GPL-3 --tokens "$tokens" --schemes all --attention "$attention" \
  --json "$out/eval$suffix.json" --markdown "$out/eval$suffix.md"
"$cache/venv/bin/python" examples/llama/plot_pareto.py "$out/eval$suffix.json" "$out/pareto$suffix.png"
echo "sweep: wrote $out/eval$suffix.json, $out/eval$suffix.md, $out/pareto$suffix.png"
