"""IQ4_NL, IQ4_XS and F16 GGUFs of the llama3_a fixture, made by llama.cpp's quantizer, and their
references: transformers on the weights those files hold.

    python3 -m pip install torch transformers gguf accelerate
    CMAKE_ARGS="-DGGML_NATIVE=ON" python3 -m pip install llama-cpp-python==0.3.36   # builds llama.cpp
    python3 scripts/oracle/make_llama3_quants.py tests/fixtures

Reads llama3_gguf/llama3_a.f32.gguf (scripts/oracle/make_gguf.py) and writes into llama3_gguf/:
llama3_a.iq4_nl.gguf, llama3_a.iq4_xs.gguf and llama3_a.f16.gguf (llama_model_quantize, one
thread; llama.cpp keeps IQ4_XS for the rows of 256 values, the ffn_down matrices, and IQ4_NL for
the 128-wide ones; the F16 file rounds every matrix to f16), and for each a `.expected.json`: the prompts of llama3_a/expected.json run by transformers (float32,
eager attention, 16 greedy tokens with EOS ignored, an all-ones attention mask, as
make_oracle.py runs them) on llama3_a's checkpoint with every weight replaced by the GGUF's,
dequantized by gguf-py (llama.cpp's own Python reader). transformers' GGUF loader does that
dequantization, but it drops the Llama 3 RoPE scaling the file keeps as `rope_freqs.weight`, so
the weights are moved into the safetensors checkpoint's model, whose config has it.
"""
import hashlib, json, os, sys

import llama_cpp
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

fixtures = sys.argv[1]
gguf_dir = os.path.join(fixtures, "llama3_gguf")
source = os.path.join(fixtures, "llama3_a")
expected = json.load(open(os.path.join(source, "expected.json")))
FTYPES = {"iq4_nl": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL, "iq4_xs": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
          "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}
MAX_NEW = 16


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


for name, ftype in FTYPES.items():
    out = os.path.join(gguf_dir, f"llama3_a.{name}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    if llama_cpp.llama_model_quantize(os.path.join(gguf_dir, "llama3_a.f32.gguf").encode(), out.encode(), params) != 0:
        sys.exit(f"llama_model_quantize failed for {name}")

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
    dequantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=os.path.basename(out), dtype=torch.float32)
    state = dequantized.state_dict()
    missing = [k for k in model.state_dict() if k not in state]
    if missing:
        sys.exit(f"{name}: the GGUF lacks {missing}")
    model.load_state_dict({k: state[k] for k in model.state_dict()})

    # One sequence, EOS ignored: nothing is padded (the mask is given, all ones).
    gc = GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
                          repetition_penalty=None, temperature=None, top_p=None, top_k=None,
                          eos_token_id=None, pad_token_id=0, bos_token_id=None)
    prompts = []
    for prompt in expected["prompts"]:
        ids = torch.tensor([prompt["ids"]])
        with torch.no_grad():
            last = model(ids).logits[0, -1].float()
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                 output_scores=True, return_dict_in_generate=True)
        scores = torch.stack([s[0].float() for s in gen.scores])
        top2 = torch.topk(scores, 2, dim=-1).values
        prompts.append({
            "ids": prompt["ids"],
            "greedy_new_ids": gen.sequences[0, ids.shape[1]:].tolist(),
            "last_logits_full": [float(v) for v in last],
            "greedy_step_top2_margin": [round(float(v), 6) for v in top2[:, 0] - top2[:, 1]],
        })
    json.dump({
        "made_by": "scripts/oracle/make_llama3_quants.py",
        "gguf": os.path.basename(out),
        "gguf_sha256": sha256(out),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "llama_cpp_python": llama_cpp.__version__},
        "compute_dtype": "float32",
        "weights": "llama3_a's checkpoint with every weight replaced by the GGUF's, dequantized by gguf-py",
        "generation": {"max_new_tokens": MAX_NEW, "greedy": True, "eos": "ignored"},
        "prompts": prompts,
    }, open(os.path.join(gguf_dir, f"llama3_a.{name}.expected.json"), "w"), indent=1)
    print(name, os.path.getsize(out), "bytes;", [p["greedy_new_ids"][:6] for p in prompts])
