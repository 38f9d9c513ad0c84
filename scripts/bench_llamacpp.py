"""llama.cpp (through llama-cpp-python) on a GGUF: greedy decode tokens/s, batch 1.

    python bench_llamacpp.py decode MODEL.gguf PROMPT.json NEW THREADS   -> JSON on stdout
    python bench_llamacpp.py requantize IN.gguf OUT.gguf q8_0             (llama_model_quantize)
"""
import json
import sys
import time


def decode(model, prompts, new, threads):
    from llama_cpp import Llama

    prompt = json.load(open(prompts))[0]
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
    llm.reset()
    llm.eval(prompt)
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
    print(json.dumps({"tokens_per_second": new / seconds, "new_ids": tokens}))


def requantize(src, dst, kind):
    import llama_cpp

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
             "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    sys.exit(rc)


if __name__ == "__main__":
    if sys.argv[1] == "decode":
        decode(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        requantize(sys.argv[2], sys.argv[3], sys.argv[4])
