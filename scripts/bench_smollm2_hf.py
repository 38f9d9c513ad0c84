"""Decode tokens/s of transformers (CPU, float32) on SmolLM2-135M-Instruct from the same Q4_1 GGUF
tpserve serves, on the reference prompt: prefill, then timed single-token greedy steps with the KV
cache, like tpserve eval-shard's decode timing. Usage: bench_smollm2_hf.py GGUF PROMPTS_JSON NEW THREADS"""
import json, os, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM

gguf, prompts, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                             dtype=torch.float32, attn_implementation="eager")
# transformers marks GGUF-loaded models as quantized; time a plain float32 model, as the oracle
# (/work/shared/oracle/make_smollm2.py) does.
config = model.config.to_dict(); config.pop("quantization_config", None)
plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32, attn_implementation="eager")
plain.load_state_dict(model.state_dict(), strict=False)
model = plain.eval()
ids = torch.tensor([json.load(open(prompts))[0]])
with torch.inference_mode():
    out = model(ids, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    steps, start = 0, time.perf_counter()
    for _ in range(new - 1):
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps += 1
    elapsed = time.perf_counter() - start
print(json.dumps({"decode_tokens": steps, "decode_seconds": elapsed, "tokens_per_second": steps / elapsed}))
