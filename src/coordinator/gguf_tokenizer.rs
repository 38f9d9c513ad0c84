//! The tokenizer and chat template of a GGUF file, built from its metadata.
//!
//! GGUF stores a GPT-2 style byte-level BPE as `tokenizer.ggml.{tokens,merges,token_type}`,
//! and names the text splitting before it in `tokenizer.ggml.pre`. We write the tokenizer.json
//! transformers' GGUF converter would produce (byte-level BPE, the pre-tokenizer that name
//! stands for, control tokens as special added tokens) and let `tokenizers` parse it, so
//! encoding matches transformers exactly.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::chat_template::ChatTemplate;
use crate::model::gguf::{GgufFile, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};


/// Qwen2's split (Qwen2.5, Qwen3): GPT-2's, but contractions in any case, one digit per piece,
/// and a letter run may take one leading non-letter, non-digit character.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split: Qwen2's, but digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How the text is cut and normalised before BPE for one `tokenizer.ggml.pre` name.
struct PreTokenization {
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// A piece that is itself in the vocabulary is one token, whatever the merges would make of
    /// it (Llama 3's tokenizer.json sets this).
    ignore_merges: bool,
}

/// The normalizer, pre-tokenizer and decoder of the split `tokenizer.ggml.pre` names, as the
/// model's own tokenizer.json has them (transformers' GGUF converter builds the same).
fn pre_tokenization(pre: Option<&str>, add_prefix_space: bool) -> Result<PreTokenization> {
    // The split regex inside a Sequence, then the byte-level step without its own regex.
    let split_then_bytes = |regex: &str, trim_offsets: bool| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets, "use_regex": false},
        ]})
    };
    match pre {
        // GPT-2's regex inside the byte-level step: what "gpt2" and "gpt-2" name, and what
        // transformers builds from any GGUF whatever its split says, SmolLM2's "smollm" among
        // them (the reference of tests/smollm2.rs). "default" and no field at all are files
        // written before llama.cpp recorded the split.
        None | Some("default" | "gpt2" | "gpt-2" | "smollm") => Ok(PreTokenization {
            normalizer: Value::Null,
            pre_tokenizer: json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": true}),
            decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
            ignore_merges: false,
        }),
        Some("qwen2") => Ok(PreTokenization {
            normalizer: json!({"type": "NFC"}),
            pre_tokenizer: split_then_bytes(QWEN2_SPLIT, false),
            decoder: json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
            ignore_merges: false,
        }),
        // Llama 3.x (and models that reuse its tokenizer). No normalizer.
        Some("llama-bpe") => Ok(PreTokenization {
            normalizer: Value::Null,
            pre_tokenizer: split_then_bytes(LLAMA3_SPLIT, true),
            decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
            ignore_merges: true,
        }),
        // Another split would tokenize text differently from the model's training: refused
        // rather than served with wrong ids.
        Some(other) => bail!(
            "GGUF metadata \"tokenizer.ggml.pre\" is \"{other}\", a pre-tokenizer tpserve does not implement \
             (default, gpt2, gpt-2, smollm, qwen2, llama-bpe)"
        ),
    }
}

/// The tokenizer.json that the metadata describes.
pub fn tokenizer_json(file: &GgufFile) -> Result<Value> {
    let model = file.opt_string("tokenizer.ggml.model")?.unwrap_or("");
    if model != "gpt2" {
        bail!("GGUF tokenizer model \"{model}\" is not supported (only gpt2, byte-level BPE)");
    }
    let add_prefix_space = file.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(false);
    let pre = pre_tokenization(file.opt_string("tokenizer.ggml.pre")?, add_prefix_space)?;
    let tokens = file.string_list("tokenizer.ggml.tokens")?;
    let merges = file.string_list("tokenizer.ggml.merges")?;
    let types = file.opt_int_list("tokenizer.ggml.token_type")?.unwrap_or_default();
    if !types.is_empty() && types.len() != tokens.len() {
        bail!("GGUF metadata has {} token types for {} tokens", types.len(), tokens.len());
    }
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        vocab.insert((*token).to_owned(), id.into());
    }
    let mut added = Vec::new();
    for (id, kind) in types.iter().enumerate() {
        if *kind == TOKEN_TYPE_CONTROL || *kind == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tokens[id], "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": *kind == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let bos = file.opt_u64("tokenizer.ggml.bos_token_id")?;
    // BOS is prepended only when the metadata says so (SmolLM2's chat template writes its own).
    let single = match (file.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false), bos) {
        (true, Some(bos)) => {
            let content = tokens.get(bos as usize).with_context(|| format!("bos_token_id {bos} is outside the vocabulary"))?;
            (vec![json!({"SpecialToken": {"id": content, "type_id": 0}}), json!({"Sequence": {"id": "A", "type_id": 0}})], Some((*content, bos)))
        }
        _ => (vec![json!({"Sequence": {"id": "A", "type_id": 0}})], None),
    };
    let mut special_tokens = serde_json::Map::new();
    if let Some((content, id)) = single.1 {
        special_tokens.insert(content.to_owned(), json!({"id": content, "ids": [id], "tokens": [content]}));
    }
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": pre.normalizer,
        "pre_tokenizer": pre.pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": single.0,
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": special_tokens,
        },
        "decoder": pre.decoder,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": pre.ignore_merges,
            "vocab": vocab, "merges": merges,
        },
    }))
}

pub fn tokenizer(file: &GgufFile) -> Result<Tokenizer> {
    let json = tokenizer_json(file)?.to_string();
    json.parse::<Tokenizer>()
        .map_err(|err| anyhow::anyhow!("{err}"))
        .with_context(|| format!("cannot build the tokenizer of {}", file.path().display()))
}

/// The chat template (`tokenizer.chat_template`), with the bos/eos token strings it may use.
pub fn chat_template(file: &GgufFile) -> Result<Option<ChatTemplate>> {
    let Some(source) = file.opt_string("tokenizer.chat_template")? else {
        return Ok(None);
    };
    let tokens = file.string_list("tokenizer.ggml.tokens")?;
    let token = |key: &str| -> Result<Option<String>> {
        Ok(file.opt_u64(key)?.and_then(|id| tokens.get(id as usize)).map(|t| (*t).to_owned()))
    };
    ChatTemplate::new(source.to_owned(), token("tokenizer.ggml.bos_token_id")?, token("tokenizer.ggml.eos_token_id")?)
        .with_context(|| format!("chat template of {}", file.path().display()))
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_split_it_does_not_implement() {
        let err = format!("{:#}", pre_tokenization(Some("deepseek-llm"), false).err().unwrap());
        assert!(err.contains("\"deepseek-llm\"") && err.contains("llama-bpe"), "{err}");
    }

    /// Qwen's split keeps digits apart and lets a letter run take one leading symbol.
    #[test]
    fn qwen2_splits_like_qwen() {
        let split = pre_tokenization(Some("qwen2"), false).unwrap();
        assert_eq!(split.normalizer["type"], "NFC");
        let pre: tokenizers::PreTokenizerWrapper = serde_json::from_value(split.pre_tokenizer).unwrap();
        let mut text = tokenizers::PreTokenizedString::from("(abc 2024 I'LL");
        tokenizers::PreTokenizer::pre_tokenize(&pre, &mut text).unwrap();
        let pieces: Vec<String> = text.get_splits(tokenizers::OffsetReferential::Original, tokenizers::OffsetType::Char).into_iter().map(|(s, _, _)| s.to_owned()).collect();
        assert_eq!(pieces, ["(abc", "Ġ", "2", "0", "2", "4", "ĠI", "'LL"]);
    }
}
