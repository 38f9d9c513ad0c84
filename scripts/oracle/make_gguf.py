"""GGUF files of the Qwen3 and Llama 3 fixtures, made by llama.cpp's own converter
(convert_hf_to_gguf.py), as a user's GGUF is made. The references stay transformers' outputs on the safetensors
checkpoints (each fixture's expected.json): a GGUF of the same weights must give them.

    python3 -m pip install torch transformers numpy sentencepiece cmake scikit-build-core
    # the sdist (pip reads its metadata, which needs cmake and scikit-build-core at hand)
    python3 -m pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps \
        --no-build-isolation -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp   # vendor/llama.cpp inside
    LLAMA_CPP_DIR=/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        python3 scripts/oracle/make_gguf.py tests/fixtures

Writes into qwen3_gguf/: qwen3_a.f32.gguf, qwen3_a.q8_0.gguf, qwen3_b.f32.gguf,
qwen3_c_bf16.bf16.gguf, qwen3_moe_b.f32.gguf, qwen3_moe_b.q8_0.gguf (weights; the MoE files have
architecture "qwen3moe" and each layer's experts stacked in one tensor per projection) and qwen3_tokenizer.gguf (the real Qwen3 tokenizer and chat
template of qwen3_chat, --vocab-only); into llama3_gguf/: llama3_a.f32.gguf and llama3_a.q8_0.gguf
(Llama 3 RoPE scaling, which the converter stores as the `rope_freqs.weight` tensor) and llama.cpp's
own Llama 3 vocabulary test (models/ggml-vocab-llama-bpe.gguf: Meta-Llama-3-8B's tokenizer,
split "llama-bpe", with the .inp strings and the .out ids transformers' tokenizer gives them).

The tiny fixtures' tokenizer is a 448-token byte-level BPE with GPT-2's split, which the
converter's table of known tokenizers does not list; it is written as llama.cpp's "gpt-2" (the
same split). The real Qwen3 tokenizer is recognised by the converter itself ("qwen2").
"""
import json, os, runpy, shutil, subprocess, sys, tempfile

llama_cpp = os.environ["LLAMA_CPP_DIR"]
fixtures = sys.argv[1]
out = os.path.join(fixtures, "qwen3_gguf")
llama_out = os.path.join(fixtures, "llama3_gguf")
os.makedirs(out, exist_ok=True)
os.makedirs(llama_out, exist_ok=True)


def convert(model_dir, outfile, *args, pre=None):
    code = (
        "import os, runpy, sys\n"
        f"sys.path[:0] = [{llama_cpp!r}, os.path.join({llama_cpp!r}, 'gguf-py')]\n"
        "import conversion.base as base\n"
        f"pre = {pre!r}\n"
        "if pre: base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {model_dir!r}, '--outfile', {outfile!r}] + {list(args)!r}\n"
        f"runpy.run_path(os.path.join({llama_cpp!r}, 'convert_hf_to_gguf.py'), run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


for case, outtype in [("qwen3_a", "f32"), ("qwen3_a", "q8_0"), ("qwen3_b", "f32"), ("qwen3_c_bf16", "bf16"),
                      ("qwen3_moe_b", "f32"), ("qwen3_moe_b", "q8_0")]:
    convert(os.path.join(fixtures, case), os.path.join(out, f"{case}.{outtype}.gguf"), "--outtype", outtype, pre="gpt-2")

# The converter wants a model config beside the tokenizer: qwen3_a's, over Qwen3's vocabulary.
with tempfile.TemporaryDirectory() as tmp:
    d = os.path.join(tmp, "qwen3_tokenizer")  # the file's general.name comes from the folder's
    os.mkdir(d)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(fixtures, "qwen3_chat", name), d)
    config = json.load(open(os.path.join(fixtures, "qwen3_a", "config.json")))
    config["vocab_size"] = 151936
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    convert(d, os.path.join(out, "qwen3_tokenizer.gguf"), "--vocab-only")

for outtype in ["f32", "q8_0"]:
    convert(os.path.join(fixtures, "llama3_a"), os.path.join(llama_out, f"llama3_a.{outtype}.gguf"), "--outtype", outtype, pre="gpt-2")
for suffix in ["", ".inp", ".out"]:
    shutil.copy(os.path.join(llama_cpp, "models", "ggml-vocab-llama-bpe.gguf" + suffix), llama_out)
