//! Qwen3 and Qwen3 MoE from GGUF files, as llama.cpp's converter writes them
//! (tests/fixtures/qwen3_gguf, from scripts/oracle/make_gguf.py): the tiny qwen3_a, qwen3_b and
//! qwen3_moe_b fixtures in f32 and Q8_0, qwen3_c_bf16 in bf16, and the real Qwen3 tokenizer and
//! chat template as a vocabulary-only file.
//!
//! The references are transformers' outputs on the safetensors checkpoints of the same weights
//! (each fixture's expected.json) and transformers' tokenizer and renderings for qwen3_chat.

mod common;

use std::path::PathBuf;

use tokenizers::Tokenizer;
use tpserve::coordinator::gguf_tokenizer;
use tpserve::model::gguf::GgufFile;
use tpserve::model::Model;

use common::qwen3_chat::{CASES, case, inputs, messages, oracle_dir, reference_ids, text};
use common::ShardRun;

const EOS: u32 = 2;

fn gguf(name: &str) -> PathBuf {
    common::fixture("qwen3_gguf").join(name)
}

fn prompts(case: &str) -> Vec<Vec<u32>> {
    common::expected(case).into_iter().map(|p| p.ids).collect()
}

fn load(path: &std::path::Path, dtype: &str) -> Model {
    common::load_tp1(path, dtype).0
}

/// The tokenizer built from the converter's metadata (split "qwen2": Qwen's regex and NFC)
/// encodes and decodes exactly like the real Qwen3 tokenizer.json.
#[test]
fn tokenizer_from_metadata_matches_the_real_qwen3_tokenizer() {
    let file = GgufFile::open(&gguf("qwen3_tokenizer.gguf")).unwrap();
    assert_eq!(file.opt_string("tokenizer.ggml.pre").unwrap(), Some("qwen2"));
    let ours = gguf_tokenizer::tokenizer(&file).unwrap();
    let reference = Tokenizer::from_file(oracle_dir().join("tokenizer.json")).unwrap();
    // The converter pads the vocabulary to the embedding's 151,936 rows.
    assert_eq!(ours.get_vocab_size(true), 151_936);
    common::assert_same_tokenization(&ours, &reference, &common::varied_strings(3000));
}

/// The chat template from metadata renders transformers' strings for every conversation
/// (tools, a tool round trip, enable_thinking), and the tokenizer from metadata gives its ids.
#[test]
fn chat_template_from_metadata_renders_like_transformers() {
    let file = GgufFile::open(&gguf("qwen3_tokenizer.gguf")).unwrap();
    let template = gguf_tokenizer::chat_template(&file).unwrap().expect("the GGUF has the Qwen3 template");
    let tokenizer = gguf_tokenizer::tokenizer(&file).unwrap();
    for name in CASES {
        let case = case(name);
        let rendered = template.render_with(&messages(&case), true, &inputs(&case)).unwrap();
        assert_eq!(rendered, text(&case, "rendered").unwrap(), "case {name}");
        assert_eq!(tokenizer.encode(rendered.as_str(), false).unwrap().get_ids(), reference_ids(&case).as_slice(), "case {name}");
    }
    let config = file.model_config().unwrap();
    assert_eq!(config.model_type, "qwen3");
    // <|im_end|> from eos_token_id, then <|endoftext|>: Qwen3's generation_config.json.
    assert_eq!(config.eos_token_ids, vec![151_645, 151_643]);
}

/// The f32 files through the ranks' model code at TP 1 and 2: the greedy ids equal
/// transformers' on the safetensors checkpoint, and the last prompt position's logits are
/// within float32 noise. qwen3_b has untied embeddings and heads * head_dim != hidden (the
/// head size comes from `qwen3.attention.key_length`).
#[test]
fn f32_files_match_transformers_at_tp1_and_tp2() {
    for case in ["qwen3_a", "qwen3_b"] {
        let path = gguf(&format!("{case}.f32.gguf"));
        for tp in [1, 2] {
            let got = ShardRun::new(&path, &prompts(case), tp).run();
            common::assert_matches_oracle(&format!("{case} GGUF f32 TP {tp}"), case, &got);
        }
    }
}

/// The bf16 file (qwen3_c_bf16's weights): `--dtype auto` holds its matrices in bf16 where the
/// CPU multiplies bf16 weights fast (AVX2 and up, computing in f32), as it does a bf16
/// safetensors checkpoint, and the greedy ids and logits equal transformers' f32 computation of
/// the same bf16 weights at TP 1 and 2.
#[test]
fn bf16_file_stays_bf16_and_matches_transformers() {
    let path = gguf("qwen3_c_bf16.bf16.gguf");
    let bf16 = tpserve_kernels::cpu_matmul::half_weights_fast();
    let (auto, f32) = (load(&path, "auto"), load(&path, "f32"));
    eprintln!("qwen3_c_bf16 GGUF: --dtype auto holds {} bytes, f32 {} (bf16 kernels: {bf16})", auto.weight_bytes(), f32.weight_bytes());
    if bf16 {
        assert!(auto.weight_bytes() * 10 < f32.weight_bytes() * 6, "{} against {} bytes", auto.weight_bytes(), f32.weight_bytes());
    }
    for tp in [1, 2] {
        let got = ShardRun { flags: &["--dtype", "auto"], ..ShardRun::new(&path, &prompts("qwen3_c_bf16"), tp) }.run();
        common::assert_matches_oracle(&format!("qwen3_c_bf16 GGUF bf16 TP {tp}"), "qwen3_c_bf16", &got);
    }
}

/// The Q8_0 file kept in its blocks (`--dtype auto`), against the same file dequantized
/// (`--dtype f32`): teacher-forced over the f32 path's greedy ids, the largest logit difference
/// and top-1 agreement; and a TP 2 group (each rank reading its slice of the blocks) against the
/// in-process TP 1 run.
#[test]
fn q8_0_file_stays_in_blocks_and_close_to_its_f32_path() {
    // Activations are quantized per rank slice at TP 2, so not bit-identical.
    common::assert_quantized_gguf_close_to_its_f32_path("qwen3_a", &gguf("qwen3_a.q8_0.gguf"), "q8_0", &prompts("qwen3_a"), EOS, 0.05);
}

/// Qwen3 MoE files (architecture "qwen3moe", each layer's experts stacked per projection) of
/// qwen3_moe_b (8 experts, top 2, every layer sparse): the f32 file at TP 1, 2 and 4 gives
/// transformers' greedy ids and logits on the safetensors checkpoint; the Q8_0 file keeps every
/// expert in its blocks (each rank cutting its slice of each from the stack), close to the same
/// file dequantized, and a TP 2 group close to TP 1.
#[test]
fn qwen3_moe_files_match_transformers_and_stay_in_blocks() {
    let config = GgufFile::open(&gguf("qwen3_moe_b.f32.gguf")).unwrap().model_config().unwrap();
    assert_eq!((config.model_type.as_str(), config.text_config["num_experts"].as_u64()), ("qwen3_moe", Some(8)));
    assert_eq!(config.text_config["mlp_only_layers"], serde_json::json!([]));
    let prompts = prompts("qwen3_moe_b");
    for tp in [1, 2, 4] {
        let got = ShardRun::new(&gguf("qwen3_moe_b.f32.gguf"), &prompts, tp).run();
        common::assert_matches_oracle(&format!("qwen3_moe_b GGUF f32 TP {tp}"), "qwen3_moe_b", &got);
    }

    // At TP 2 a rank's slice of an expert's down projection is 16 columns, half a Q8_0 block,
    // so it holds them in f32 (and logs it) where TP 1 holds Q8_0: the two differ by Q8_0's
    // error on those matrices (0.05-0.21 here), not by float noise. The logits' standard
    // deviation is about 1, so a wrong slice misses by far more.
    common::assert_quantized_gguf_close_to_its_f32_path("qwen3_moe_b", &gguf("qwen3_moe_b.q8_0.gguf"), "q8_0", &prompts, EOS, 0.5);
}

/// `tpserve serve --model qwen3_a.q8_0.gguf --tp 2` and `tpserve chat`: the coordinator takes
/// the tokenizer and chat template from the file's metadata, the ranks keep Q8_0 blocks (the
/// startup log says so), and a greedy chat streams to its length limit.
#[test]
fn serve_streams_a_chat_from_a_qwen3_gguf() {
    common::assert_serves_a_chat(&gguf("qwen3_a.q8_0.gguf"), 2, "q8_0");
}

/// A truncated file (a download cut short) is refused at load with a message naming the tensor
/// that lies beyond its end, whether its blocks are kept (`auto`) or dequantized (`f32`).
#[test]
fn a_truncated_file_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.gguf");
    let bytes = std::fs::read(gguf("qwen3_a.q8_0.gguf")).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    for dtype in ["auto", "f32"] {
        let (dtype, quant) = tpserve::model::parse_load_dtype(dtype, "", &candle_core::Device::Cpu, &path).unwrap();
        let options = tpserve::model::LoadOptions { dtype, device: candle_core::Device::Cpu, products: tpserve::model::Products::Exact };
        let progress = std::sync::Arc::new(tpserve::model::loader::LoadProgress::default());
        let group = tpserve::model::parallel::TpGroup::single();
        let err = Model::load_quantized(&path, &group, &options, quant, progress).err().expect("a truncated file must be refused");
        let err = format!("{err:#}");
        assert!(err.contains("cannot read GGUF tensor") && err.contains("beyond the file's end"), "{err}");
    }
}
