"""llama.cpp (through llama-cpp-python) on a GGUF: greedy decode tokens/s, batch 1.

    python bench_llamacpp.py decode MODEL.gguf PROMPT.json NEW THREADS   -> JSON on stdout
        (decode and prompt tokens/s, the seconds Llama() took to open the model, the greedy ids)
    python bench_llamacpp.py requantize IN.gguf OUT.gguf q8_0|q4_0|q4_k|q5_k|q6_k|q3_k|q2_k|iq4_xs|f16  (llama_model_quantize;
        q4_k, q5_k, q3_k: the _M mixes)
    python bench_llamacpp.py reference MODEL.gguf EXPECTED.json NEW > OUT.json
        llama.cpp's greedy ids for each prompt of a fixture's expected.json (the reference
        tests/fixtures/smollm2_135m/llamacpp_greedy.json was made this way)
"""
import json
import sys
import time


def decode(model, prompts, new, threads):
    from llama_cpp import Llama

    prompt = json.load(open(prompts))[0]
    n_ctx = max(1024, len(prompt) + new + 16)
    loading = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512, verbose=False)
    load = time.perf_counter() - loading
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - started)
    tokens = []
    start = None
    for _ in range(new):
        token = llm.sample(top_k=1, temp=0.0)
        tokens.append(int(token))
        if start is None:
            start = time.perf_counter()  # the prompt's evaluation is behind us
        llm.eval([token])
    seconds = time.perf_counter() - start
    # the first sampled token came from the prefill; NEW single-token evals were timed after it
    print(json.dumps({"tokens_per_second": new / seconds, "prefill_tokens_per_second": prefill, "load_seconds": load, "new_ids": tokens}))


def reference(model, expected, new):
    import hashlib

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=2, n_threads_batch=2, n_ctx=1024, n_batch=512, verbose=False)
    prompts = []
    for prompt in json.load(open(expected))["prompts"]:
        llm.reset()
        llm.eval(prompt["prompt_ids"])
        ids = []
        for _ in range(new):
            token = int(llm.sample(top_k=1, temp=0.0))
            ids.append(token)
            llm.eval([token])
        prompts.append({"prompt_ids": prompt["prompt_ids"], "greedy_new_ids": ids})
    print(json.dumps({
        "made_by": "scripts/bench_llamacpp.py reference (greedy, EOS not stopping, n_threads 2)",
        "llama_cpp_python": llama_cpp.__version__,
        "gguf_sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(),
        "prompts": prompts,
    }, indent=1))


def requantize(src, dst, kind):
    import llama_cpp

    kind = kind.removesuffix("_m")  # q4_k_m: the Q4_K_M mix, as q4_k
    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
             "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
             "q5_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M, "q3_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
             "q2_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
             "iq4_xs": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    sys.exit(rc)


if __name__ == "__main__":
    if sys.argv[1] == "decode":
        decode(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "reference":
        reference(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        requantize(sys.argv[2], sys.argv[3], sys.argv[4])
