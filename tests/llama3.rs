//! Llama 3: its RoPE scaling and its tokenizer's split, from safetensors and from GGUF files
//! as llama.cpp's converter writes them (tests/fixtures/llama3_gguf, scripts/oracle/make_gguf.py).
//!
//! The references are transformers' outputs on the llama3_a safetensors checkpoint (its
//! expected.json), the ids transformers' tokenizer of Meta-Llama-3-8B gives llama.cpp's
//! vocabulary test strings (ggml-vocab-llama-bpe.gguf.inp / .out, from llama.cpp's models/), and
//! transformers' renderings of Meta's Llama 3.1/3.2/3.3 chat templates (tests/fixtures/llama3_chat).

mod common;

use std::path::PathBuf;

use serde_json::Value;
use tokenizers::Tokenizer;
use tpserve::coordinator::chat_template::ChatTemplate;
use tpserve::coordinator::{gguf_tokenizer, pyjson};
use tpserve::model::config::RopeScaling;
use tpserve::model::gguf::GgufFile;
use tpserve::rank::offline;

use common::ShardRun;

const EOS: u32 = 2;

fn gguf(name: &str) -> PathBuf {
    common::fixture("llama3_gguf").join(name)
}

fn prompts() -> Vec<Vec<u32>> {
    common::expected("llama3_a").into_iter().map(|p| p.ids).collect()
}

/// llama.cpp's vocabulary test: each string of the .inp file and the ids of the same line of
/// the .out file.
fn vocabulary_test() -> Vec<(String, Vec<u32>)> {
    let inputs = std::fs::read_to_string(gguf("ggml-vocab-llama-bpe.gguf.inp")).unwrap();
    let outputs = std::fs::read_to_string(gguf("ggml-vocab-llama-bpe.gguf.out")).unwrap();
    let mut texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    assert_eq!(texts.pop(), Some(""), "every string ends with the separator");
    let ids: Vec<Vec<u32>> = outputs.lines().map(|line| line.split_whitespace().map(|id| id.parse().unwrap()).collect()).collect();
    assert_eq!(texts.len(), ids.len());
    texts.into_iter().map(str::to_owned).zip(ids).collect()
}

/// The vocabulary test's strings that `tokenizer` encodes to other ids than transformers'.
fn mismatches(tokenizer: &Tokenizer, cases: &[(String, Vec<u32>)]) -> Vec<String> {
    cases
        .iter()
        .filter(|(text, ids)| tokenizer.encode(text.as_str(), false).unwrap().get_ids() != ids.as_slice())
        .map(|(text, _)| text.clone())
        .collect()
}

/// The tokenizer built from a Llama 3 GGUF's metadata (split "llama-bpe": Llama 3's regex, and
/// a piece found whole in the vocabulary kept whole) gives transformers' ids for every string of
/// llama.cpp's vocabulary test and decodes them back to the string. GPT-2's split or BPE that
/// applies merges to every piece each miss some, so the test tells them apart.
#[test]
fn llama_bpe_tokenizer_matches_transformers() {
    let file = GgufFile::open(&gguf("ggml-vocab-llama-bpe.gguf")).unwrap();
    assert_eq!(file.opt_string("tokenizer.ggml.pre").unwrap(), Some("llama-bpe"));
    let json = gguf_tokenizer::tokenizer_json(&file).unwrap();
    let ours: Tokenizer = json.to_string().parse().unwrap();
    assert_eq!(ours.get_vocab_size(true), 128_256);
    // <|end_of_text|> from eos_token_id, then <|eot_id|>: Llama 3 Instruct's generation_config.json.
    assert_eq!(file.model_config().unwrap().eos_token_ids, vec![128_001, 128_009]);
    let cases = vocabulary_test();
    assert!(cases.len() >= 40, "{} strings", cases.len());
    assert_eq!(mismatches(&ours, &cases), Vec::<String>::new());
    for (text, ids) in &cases {
        assert_eq!(&ours.decode(ids, false).unwrap(), text, "ids {ids:?} decode back");
    }

    let variant = |edit: &dyn Fn(&mut Value)| -> Tokenizer {
        let mut json = json.clone();
        edit(&mut json);
        json.to_string().parse().unwrap()
    };
    let gpt2_split = variant(&|j| j["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}));
    let all_merges = variant(&|j| j["model"]["ignore_merges"] = false.into());
    let (gpt2, merged) = (mismatches(&gpt2_split, &cases), mismatches(&all_merges, &cases));
    println!("strings tokenized differently: GPT-2's split {}, every piece merged {}", gpt2.len(), merged.len());
    assert!(!gpt2.is_empty() && !merged.is_empty(), "the vocabulary test must tell each variant apart");
}

/// Meta's Llama 3.1, 3.2 and 3.3 Instruct templates render every conversation exactly as
/// transformers does (system prompt trimmed and dated, tools in the first user message or in the
/// system message, a tool call and its result as `ipython`, 3.1's built-in tools), and the
/// llama-bpe tokenizer makes each special-token string its one control id.
#[test]
fn llama3_chat_templates_render_like_transformers() {
    use common::qwen3_chat::{inputs, messages, text};
    let dir = common::fixture("llama3_chat");
    let oracle = pyjson::parse(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let tokenizer = gguf_tokenizer::tokenizer(&GgufFile::open(&gguf("ggml-vocab-llama-bpe.gguf")).unwrap()).unwrap();
    let mut rendered_cases = 0;
    for case in oracle.get_attr("cases").unwrap().try_iter().unwrap() {
        let label = format!("{} {}", text(&case, "template").unwrap(), text(&case, "name").unwrap());
        let source = std::fs::read_to_string(dir.join(text(&case, "template").unwrap())).unwrap();
        let template = ChatTemplate::new(source, Some("<|begin_of_text|>".into()), Some("<|eot_id|>".into())).unwrap();
        let rendered = template.render_with(&messages(&case), true, &inputs(&case)).unwrap();
        assert_eq!(rendered, text(&case, "rendered").unwrap(), "{label}");

        let ids = tokenizer.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(ids[0], 128_000, "{label}: <|begin_of_text|> first");
        for (special, id) in [("<|begin_of_text|>", 128_000), ("<|start_header_id|>", 128_006), ("<|end_header_id|>", 128_007), ("<|eot_id|>", 128_009)] {
            assert_eq!(ids.iter().filter(|&&i| i == id).count(), rendered.matches(special).count(), "{label}: {special}");
        }
        rendered_cases += 1;
    }
    assert_eq!(rendered_cases, 23);
}

/// The converter stores Llama 3's RoPE scaling as one divisor per frequency
/// (`rope_freqs.weight`); the config read from the file carries them.
#[test]
fn gguf_config_carries_the_rope_divisors() {
    let config = GgufFile::open(&gguf("llama3_a.f32.gguf")).unwrap().model_config().unwrap();
    assert_eq!((config.model_type.as_str(), config.rope_theta), ("llama", 500_000.0));
    let RopeScaling::Divisors(divisors) = &config.rope_scaling else { panic!("{:?}", config.rope_scaling) };
    assert_eq!(divisors.len(), config.head_dim / 2);
    assert_eq!((divisors[0], divisors[7]), (1.0, 32.0), "{divisors:?}");
}

/// The fixture tells scaled from plain RoPE: the same checkpoint with its rope_parameters set
/// to the default misses transformers' logits by far more than float32 noise.
#[test]
fn without_its_rope_scaling_the_model_misses_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let source = common::fixture("llama3_a");
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();

    let (plain, _) = common::load_tp1(dir.path(), "f32");
    let expected = common::expected("llama3_a");
    let worst = expected
        .iter()
        .map(|prompt| {
            let got = offline::greedy(&plain, 1, &prompt.ids, 1, 0, &[EOS]).unwrap().unwrap();
            common::max_abs_diff(&got.last_logits, &prompt.last_logits)
        })
        .fold(0f32, f32::max);
    println!("llama3_a with default RoPE: max |logit - transformers| = {worst:.3e}");
    assert!(worst > 1e-2, "default RoPE gives the scaled reference's logits ({worst}): the fixture does not test the scaling");
}

/// The f32 file through the ranks' model code at TP 1 and 2 (q/k rows un-permuted, RoPE
/// divided per frequency): greedy ids equal transformers' on the safetensors checkpoint and the
/// last prompt position's logits within float32 noise.
#[test]
fn f32_file_matches_transformers_at_tp1_and_tp2() {
    let path = gguf("llama3_a.f32.gguf");
    for tp in [1, 2] {
        let got = ShardRun::new(&path, &prompts(), tp).run();
        common::assert_matches_oracle(&format!("llama3_a GGUF f32 TP {tp}"), "llama3_a", &got);
    }
}

/// The Q8_0 file kept in its blocks (`--dtype auto`) against the same file dequantized, and
/// at TP 2 against TP 1 (activations are quantized per rank slice, so not bit-identical).
#[test]
fn q8_0_file_stays_in_blocks_and_close_to_its_f32_path() {
    common::assert_quantized_gguf_close_to_its_f32_path("llama3_a", &gguf("llama3_a.q8_0.gguf"), "q8_0", &prompts(), EOS, 0.05);
}

/// llama.cpp's IQ4_NL and IQ4_XS files of the same checkpoint (types candle does not read) and
/// its F16 file, dequantized (`--dtype f32`) at TP 1 and 2: greedy ids and logits equal
/// transformers' on the weights those files hold (gguf-py's dequantization,
/// scripts/oracle/make_llama3_quants.py).
#[test]
fn iq4_and_f16_files_dequantized_match_transformers_on_their_weights() {
    for kind in ["iq4_nl", "iq4_xs", "f16"] {
        let expected = common::expected_file(&gguf(&format!("llama3_a.{kind}.expected.json")));
        let prompts: Vec<Vec<u32>> = expected.iter().map(|p| p.ids.clone()).collect();
        for tp in [1, 2] {
            let got = ShardRun { flags: &["--dtype", "f32"], ..ShardRun::new(&gguf(&format!("llama3_a.{kind}.gguf")), &prompts, tp) }.run();
            common::assert_matches(&format!("llama3_a {kind} dequantized TP {tp}"), &expected, &got);
        }
    }
}

/// The IQ4 files kept quantized (`--dtype auto`) are held as IQ4_NL blocks (IQ4_NL's as they
/// are, IQ4_XS's with their scales rounded to f16): close to the dequantized path as a Q8_0 file
/// is, at TP 1 and 2.
#[test]
fn iq4_files_stay_quantized_as_iq4_nl_and_close_to_their_f32_path() {
    for kind in ["iq4_nl", "iq4_xs"] {
        let path = gguf(&format!("llama3_a.{kind}.gguf"));
        common::assert_quantized_gguf_close_to_its_f32_path(&format!("llama3_a {kind}"), &path, "iq4_nl", &prompts(), EOS, 0.05);
    }
}

/// The F16 file under `--dtype auto` keeps its matrices in f16 (half the bytes of f32) and
/// computes in f32, widening each weight exactly: the same ids and logits as transformers on
/// those weights, at TP 1 and 2.
#[test]
fn f16_file_stays_f16_and_matches_transformers() {
    let path = gguf("llama3_a.f16.gguf");
    let (f16, progress) = common::load_tp1(&path, "auto");
    let (f32, _) = common::load_tp1(&path, "f32");
    let summary = progress.format_summary();
    println!("llama3_a F16 GGUF under auto: {summary}, {} bytes against {} as f32", f16.weight_bytes(), f32.weight_bytes());
    assert!(summary.contains("f16") && !summary.contains("f32"), "{summary}");
    assert!(f16.weight_bytes() * 10 < f32.weight_bytes() * 6, "{} against {} bytes", f16.weight_bytes(), f32.weight_bytes());
    let expected = common::expected_file(&gguf("llama3_a.f16.expected.json"));
    for tp in [1, 2] {
        let got = ShardRun::new(&path, &prompts(), tp).run();
        common::assert_matches(&format!("llama3_a F16 GGUF kept f16, TP {tp}"), &expected, &got);
    }
}

/// `tpserve serve` of the Q8_0 file at TP 2 streams a chat.
#[test]
fn serve_streams_a_chat_from_a_llama3_gguf() {
    common::assert_serves_a_chat(&gguf("llama3_a.q8_0.gguf"), 2, "q8_0");
}
