//! The tokenizer and chat template of a GGUF file, built from its metadata.
//!
//! GGUF stores a GPT-2 style byte-level BPE as `tokenizer.ggml.{tokens,merges,token_type}`.
//! We write the tokenizer.json transformers' GGUF converter would produce (byte-level BPE,
//! GPT-2 regex pre-tokenizer, control tokens as special added tokens) and let `tokenizers`
//! parse it, so encoding matches transformers exactly.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::chat_template::ChatTemplate;
use crate::model::gguf::GgufFile;

/// llama.cpp's token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The tokenizer.json that the metadata describes.
pub fn tokenizer_json(file: &GgufFile) -> Result<Value> {
    let model = file.opt_string("tokenizer.ggml.model")?.unwrap_or("");
    if model != "gpt2" {
        bail!("GGUF tokenizer model \"{model}\" is not supported (only gpt2, byte-level BPE)");
    }
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
    let add_prefix_space = file.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(false);
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
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": single.0,
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": special_tokens,
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
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
