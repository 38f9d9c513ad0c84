#!/usr/bin/env bash
# Decode tokens/s on Qwen3 GGUFs, the files a CPU user downloads: tpserve keeping them quantized
# (--dtype auto) in the rank's model code (`eval-shard`) and through `tpserve serve` (a streaming
# gRPC client), against llama.cpp on the same file, batch 1, THREADS (2) threads, a PROMPT
# (32)-token prompt, NEW (64) new tokens, interleaved, best of RUNS (3); and the memory-read
# bandwidth, measured in every run (the best is the bound, over the bytes a decode step reads);
# the prompt's prefill tokens/s in the rank's code and in llama.cpp; and the seconds each takes
# to load the file. A long PROMPT (2048) measures prefill, and decode after it.
#
# SHAPE picks the model:
# - dense (default): Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query and 8 KV heads of 128,
#   intermediate 3072, tied embeddings). A decode step reads about the whole file.
# - moe: a Qwen3 MoE (architecture qwen3moe) shaped like Qwen3-30B-A3B scaled to this machine:
#   hidden 1024, 16 layers, 16 query and 4 KV heads of 128, 64 experts of intermediate 512 with 8
#   used per token (1.8B parameters, 0.3B active). A decode step reads the attention, the 8
#   chosen experts of every layer and the tied embedding as LM head, not the whole file: the
#   bytes per token printed count 8/64 of the experts.
# Both use the 151,936-token vocabulary.
#
# The checkpoint has random weights (transformers' initialization, bf16; speed does not depend
# on the values, except which experts a token picks) and the real Qwen3 tokenizer
# (tests/fixtures/qwen3_chat). llama.cpp's own converter makes the Q8_0 file, and its quantizer
# the Q4_0, Q4_K_M, IQ4_XS and F16 files from it (allow_requantize; Q4_K_M keeps some tensors in
# Q6_K; tpserve holds IQ4_XS as IQ4_NL blocks, 18 bytes per 32 values against the file's 17; the F16
# file, the Q8_0 values in f16, stands in for a model converted to f16, dense only).
# Needs a release build, a Python with torch, transformers, sentencepiece and llama-cpp-python
# (CMAKE_ARGS="-DGGML_NATIVE=ON"), and llama.cpp's converter, LLAMA_CPP_DIR (the
# vendor/llama.cpp of the llama-cpp-python sdist; see scripts/oracle/make_gguf.py). The files
# are kept in WORK (target/qwen3-gguf) for the next run.
#   cargo build --release && PYTHON=/venv/bin/python LLAMA_CPP_DIR=... [SHAPE=moe] scripts/bench-qwen3-gguf.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
THREADS=${THREADS:-2}
RUNS=${RUNS:-3}
NEW=${NEW:-64}
PROMPT=${PROMPT:-32}
WORK=${WORK:-$PWD/target/qwen3-gguf}
SHAPE=${SHAPE:-dense}
case "$SHAPE" in
  dense) NAME=qwen3-0.6b ;;
  moe) NAME=qwen3-moe-1.8b-a0.3b ;;
  *) echo "SHAPE must be dense or moe" >&2; exit 2 ;;
esac
# FORMATS (space-separated) picks some of the files; by default every one.
DEFAULT_FORMATS="Q8_0 Q4_0 Q4_K_M IQ4_XS"
[ "$SHAPE" = moe ] || DEFAULT_FORMATS+=" F16"
read -ra FORMATS <<< "${FORMATS:-$DEFAULT_FORMATS}"
mkdir -p "$WORK"
if [ ! -f "$WORK/$NAME.Q8_0.gguf" ]; then
  "$PYTHON" - "$WORK/$NAME" tests/fixtures/qwen3_chat "$SHAPE" <<'EOF'
import os, shutil, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
out, tokenizer, shape = sys.argv[1:4]
common = dict(hidden_size=1024, num_attention_heads=16, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
              rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
              eos_token_id=151645, bos_token_id=151643)
torch.manual_seed(0)
if shape == "dense":
    model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=3072, num_hidden_layers=28, num_key_value_heads=8, **common))
else:
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=3072, num_hidden_layers=16, num_key_value_heads=4,
                                               num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common))
model.to(torch.bfloat16).save_pretrained(out)
for name in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(os.path.join(tokenizer, name), out)
EOF
  "$PYTHON" - "$WORK/$NAME" "$WORK/$NAME.Q8_0.gguf" <<'EOF'
import os, runpy, sys
llama_cpp = os.environ["LLAMA_CPP_DIR"]
sys.path[:0] = [llama_cpp, os.path.join(llama_cpp, "gguf-py")]
sys.argv = ["convert_hf_to_gguf.py", sys.argv[1], "--outtype", "q8_0", "--outfile", sys.argv[2]]
runpy.run_path(os.path.join(llama_cpp, "convert_hf_to_gguf.py"), run_name="__main__")
EOF
  "$PYTHON" scripts/bench_llamacpp.py requantize "$WORK/$NAME.Q8_0.gguf" "$WORK/$NAME.Q4_0.gguf" q4_0 >/dev/null 2>&1
  "$PYTHON" scripts/bench_llamacpp.py requantize "$WORK/$NAME.Q8_0.gguf" "$WORK/$NAME.Q4_K_M.gguf" q4_k >/dev/null 2>&1
  rm -rf "$WORK/$NAME"
fi
for fmt in "${FORMATS[@]}"; do # made when missing: the formats added after the others
  if [ ! -f "$WORK/$NAME.$fmt.gguf" ]; then
    "$PYTHON" scripts/bench_llamacpp.py requantize "$WORK/$NAME.Q8_0.gguf" "$WORK/$NAME.$fmt.gguf" "${fmt,,}" >/dev/null 2>&1
  fi
done
tmp=$(mktemp -d)
servers=()
cleanup() { for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
python3 -c "import json; json.dump([[(i * 7919) % 150000 + 100 for i in range($PROMPT)]], open('$tmp/p.json', 'w'))"
# One server per file, loaded once and idle while the others run.
for fmt in "${FORMATS[@]}"; do
  target/release/tpserve serve --model "$WORK/$NAME.$fmt.gguf" --tp 1 --threads "$THREADS" \
      --listen "unix://$tmp/$fmt.sock" >"$tmp/$fmt-serve.log" 2>&1 &
  servers+=($!)
done
for fmt in "${FORMATS[@]}"; do
  for _ in $(seq 240); do target/release/tpserve health --server "unix://$tmp/$fmt.sock" >/dev/null 2>&1 && break; sleep 0.5; done
  target/release/tpserve health --server "unix://$tmp/$fmt.sock" >/dev/null || { cat "$tmp/$fmt-serve.log"; exit 1; }
done
declare -A best
record() { if python3 -c "import sys; sys.exit(0 if float('$2') > float('${best[$1]:-0}') else 1)"; then best[$1]=$2; fi; echo "  $1: $2"; }
# Load seconds: the least of the runs.
record_least() { if python3 -c "import sys; sys.exit(0 if float('$2') < float('${best[$1]:-1e9}') else 1)"; then best[$1]=$2; fi; echo "  $1: $2"; }
for run in $(seq "$RUNS"); do
  record bandwidth "$("$PYTHON" scripts/bench_cpu.py bandwidth "$THREADS")"
  echo "run $run"
  for fmt in "${FORMATS[@]}"; do
    gguf=$WORK/$NAME.$fmt.gguf
    target/release/tpserve eval-shard --model "$gguf" --dtype auto --rank 0 --world-size 1 \
        --rendezvous "unix://$tmp/c.sock" --prompts "$tmp/p.json" --max-new "$NEW" --threads "$THREADS" \
        --out "$tmp/out.json" >/dev/null 2>&1
    record "$fmt tpserve" "$(python3 -c "import json; r = json.load(open('$tmp/out.json')); print(round(r['decode_tokens'] / r['decode_seconds'], 2))")"
    record_least "$fmt tpserve load" "$(python3 -c "import json; print(round(json.load(open('$tmp/out.json'))['load_seconds'], 2))")"
    record "$fmt tpserve prefill" "$(python3 -c "import json; r = json.load(open('$tmp/out.json')); print(round(r['prefill_tokens'] / r['prefill_seconds'], 2))")"
    record "$fmt serve" "$(python3 scripts/bench_serve_stream.py "unix://$tmp/$fmt.sock" "$tmp/p.json" "$NEW" \
        | python3 -c "import json, sys; print(round(json.load(sys.stdin)['tokens_per_second'], 2))")"
    "$PYTHON" scripts/bench_llamacpp.py decode "$gguf" "$tmp/p.json" "$NEW" "$THREADS" 2>/dev/null >"$tmp/llama.json"
    record "$fmt llama.cpp" "$(python3 -c "import json; print(round(json.load(open('$tmp/llama.json'))['tokens_per_second'], 2))")"
    record_least "$fmt llama.cpp load" "$(python3 -c "import json; print(round(json.load(open('$tmp/llama.json'))['load_seconds'], 2))")"
    record "$fmt llama.cpp prefill" "$(python3 -c "import json; print(round(json.load(open('$tmp/llama.json'))['prefill_tokens_per_second'], 2))")"
  done
done
echo
echo "$NAME, tokens/s (in brackets: the bytes a decode step reads times tokens/s, a fraction of the read bandwidth, ${best[bandwidth]} GB/s):"
echo "| file | MB | MB read per token | tpserve (rank's code) | through serve | llama.cpp | tpserve / llama.cpp | through serve / llama.cpp |"
echo "|---|---|---|---|---|---|---|---|"
for fmt in "${FORMATS[@]}"; do
  gguf=$WORK/$NAME.$fmt.gguf
  mb=$(( $(stat -c %s "$gguf") / 1000000 ))
  # Every tensor once, but of the stacked experts (ffn_*_exps) only the share a token uses; then
  # the same for the blocks tpserve holds (IQ4_XS tensors as IQ4_NL: 18 bytes per 32 values).
  read "read_mb" "held_mb" < <("$PYTHON" - "$gguf" <<'EOF'
import os, sys
sys.path.insert(0, os.path.join(os.environ["LLAMA_CPP_DIR"], "gguf-py"))
import gguf
reader = gguf.GGUFReader(sys.argv[1])
arch = reader.fields["general.architecture"].contents()
field = lambda key: reader.fields[f"{arch}.{key}"].contents() if f"{arch}.{key}" in reader.fields else None
used = (field("expert_used_count") or 1) / (field("expert_count") or 1)
share = lambda t: used if "_exps" in t.name else 1
held = lambda t: t.n_elements * 18 / 32 if t.tensor_type.name == "IQ4_XS" else t.n_bytes
print(round(sum(t.n_bytes * share(t) for t in reader.tensors) / 1e6), round(sum(held(t) * share(t) for t in reader.tensors) / 1e6))
EOF
)
  python3 -c "q, s, l, bw = ${best[$fmt tpserve]}, ${best[$fmt serve]}, ${best[$fmt llama.cpp]}, ${best[bandwidth]}
share = lambda t, mb: f'{t:.1f} ({t * mb / 1000 / bw:.0%})'
read = '$read_mb' if $read_mb == $held_mb else '$read_mb (tpserve: $held_mb)'
print(f'| $fmt | $mb | {read} | {share(q, $held_mb)} | {share(s, $held_mb)} | {share(l, $read_mb)} | {q / l:.2f}x | {s / l:.2f}x |')"
done
echo
echo "prefill of the $PROMPT-token prompt, tokens/s (rank's code; llama.cpp's eval of the prompt):"
echo "| file | tpserve | llama.cpp | tpserve / llama.cpp |"
echo "|---|---|---|---|"
for fmt in "${FORMATS[@]}"; do
  python3 -c "t, l = ${best[$fmt tpserve prefill]}, ${best[$fmt llama.cpp prefill]}; print(f'| $fmt | {t:.1f} | {l:.1f} | {t / l:.2f}x |')"
done
echo
echo "seconds to load the model (least of the runs; tpserve: eval-shard's TP 1 shard; llama.cpp: Llama(), which maps the file):"
echo "| file | tpserve | llama.cpp |"
echo "|---|---|---|"
for fmt in "${FORMATS[@]}"; do
  echo "| $fmt | ${best[$fmt tpserve load]} | ${best[$fmt llama.cpp load]} |"
done
