"""Helpers of scripts/bench-cpu.sh (figures only; nothing here runs in CI).

  bench_cpu.py make DIR                     a ~100M-parameter Qwen3-shaped model with random
                                            weights: DIR/bf16 (bf16 safetensors) and DIR/f32
                                            (the same values in f32)
  bench_cpu.py torch MODEL DTYPE PROMPT NEW THREADS
                                            transformers decode tokens/s (eager attention, KV
                                            cache): prefill, then NEW - 1 timed greedy steps
  bench_cpu.py bandwidth THREADS            memory-read bandwidth (GB/s): best of 10 sums over
                                            a 1 GiB f32 tensor
  bench_cpu.py weight-bytes MODEL           bytes of matmul weights read per decode token
"""
import json, os, sys, time

import torch


def make(out):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    # The shape of benches/tp_bench.rs: 100.1M parameters, tied embeddings.
    config = Qwen3Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                         head_dim=64, intermediate_size=2048, vocab_size=32000, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(os.path.join(out, "bf16"))
    model.to(torch.float32).save_pretrained(os.path.join(out, "f32"))


def bench_torch(model_dir, dtype, prompt, new, threads):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    ids = torch.tensor([json.load(open(prompt))[0]])
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        elapsed = time.perf_counter() - start
    print(json.dumps({"decode_tokens": new - 1, "decode_seconds": elapsed, "tokens_per_second": (new - 1) / elapsed}))


def bandwidth(threads):
    torch.set_num_threads(threads)
    data = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    print(f"{data.numel() * 4 / best / 1e9:.1f}")


def weight_bytes(model_dir):
    from safetensors import safe_open
    total = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            # Norm weights are tiny; the embedding table is read as the tied LM head (one row
            # of it per token for the lookup).
            if "norm" not in name:
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F32": 4}[t.get_dtype()]
    print(total)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "make":
        make(sys.argv[2])
    elif command == "torch":
        bench_torch(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    elif command == "bandwidth":
        bandwidth(int(sys.argv[2]))
    elif command == "weight-bytes":
        weight_bytes(sys.argv[2])
