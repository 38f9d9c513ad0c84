//! Incremental detokenization for streaming.
//!
//! Decoding each generated token on its own is wrong in two ways: byte-level BPE tokens can
//! carry part of a UTF-8 character (so a lone token decodes to U+FFFD), and some decoders
//! (SentencePiece/Metaspace) drop or add spaces depending on whether a token is first in the
//! decoded slice. Re-decoding the whole sequence every step is right but quadratic. The
//! approach used by TGI and vLLM keeps two offsets into the token list: `prefix_offset` marks a
//! short window of already-emitted tokens that is re-decoded as context, `read_offset` marks
//! where the already-emitted text ends. The new text is whatever the window plus the new tokens
//! decode to beyond the context, and it is withheld while it ends in an incomplete character.

use std::sync::Arc;

use anyhow::Context;
use tokenizers::Tokenizer;

/// How many prompt tokens are decoded as context ahead of the first generated token.
///
/// A handful suffices for every decoder we know (they only look at neighbouring tokens to decide
/// on spaces), and it also covers a prompt that ends inside a multi-byte character. Same value
/// as vLLM's `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Streams text for one sequence, one generated token at a time.
///
/// Holds an `Arc<Tokenizer>` so it can live in a per-request task independent of whoever
/// loaded the tokenizer.
pub struct IncrementalDecoder {
    tokenizer: Arc<Tokenizer>,
    /// Prompt context tail followed by every generated token not yet dropped from the window.
    ids: Vec<u32>,
    /// Start of the context window (already emitted or prompt tokens).
    prefix_offset: usize,
    /// End of the tokens whose text has been emitted.
    read_offset: usize,
}

impl IncrementalDecoder {
    /// `prompt_ids` provide decoding context only: none of their text is ever emitted.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32]) -> Self {
        let start = prompt_ids.len().saturating_sub(PROMPT_CONTEXT_TOKENS);
        let ids = prompt_ids[start..].to_vec();
        let read_offset = ids.len();
        Self { tokenizer, ids, prefix_offset: 0, read_offset }
    }

    /// Adds one generated token and returns the text it completes (often empty: a special
    /// token, or a partial character waiting for the rest of its bytes).
    pub fn push(&mut self, token_id: u32) -> anyhow::Result<String> {
        self.ids.push(token_id);
        let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode(self.prefix_offset, self.ids.len())?;
        // An incomplete trailing character decodes to U+FFFD; emitting it would put a
        // replacement character into the stream that the next token would have fixed.
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = new_text[split_point(&prefix_text, &new_text)..].to_owned();
        // Slide the window: what was new becomes context. Tokens before the new prefix_offset
        // are never decoded again, so drop them to keep memory bounded on long generations.
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        Ok(delta)
    }

    /// Returns the text still held back (a trailing incomplete character, if generation ended
    /// inside one) so nothing the model produced is lost; the decoder's own replacement
    /// characters are emitted as they are at that point, since no later token can complete them.
    pub fn finish(&mut self) -> String {
        if self.read_offset >= self.ids.len() {
            return String::new();
        }
        let (Ok(prefix_text), Ok(new_text)) =
            (self.decode(self.prefix_offset, self.read_offset), self.decode(self.prefix_offset, self.ids.len()))
        else {
            tracing::warn!("detokenizer: failed to decode held-back tokens at end of stream");
            return String::new();
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        if new_text.len() <= prefix_text.len() {
            return String::new();
        }
        new_text[split_point(&prefix_text, &new_text)..].to_owned()
    }

    fn decode(&self, from: usize, to: usize) -> anyhow::Result<String> {
        self.tokenizer
            .decode(&self.ids[from..to], true)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("detokenizer: decoding generated tokens failed")
    }

    fn compact(&mut self) {
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

/// Where the new text starts inside `new_text`.
///
/// Normally `new_text` extends `prefix_text` and the answer is its length. When it does not (the
/// context itself ended in an incomplete character that the new token completed, e.g. a prompt
/// cut mid-character), the longest common prefix on a char boundary is used so the slice can
/// never panic and no completed character is lost.
fn split_point(prefix_text: &str, new_text: &str) -> usize {
    if new_text.starts_with(prefix_text) {
        return prefix_text.len();
    }
    let mut common = 0;
    for ((i, a), b) in new_text.char_indices().zip(prefix_text.chars()) {
        if a != b {
            return i;
        }
        common = i + a.len_utf8();
    }
    common
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_a/tokenizer.json");
    const SMOL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/smollm2_135m/tokenizer.json");

    fn load(path: &str) -> Arc<Tokenizer> {
        Arc::new(Tokenizer::from_file(path).unwrap())
    }

    fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, false).unwrap().get_ids().to_vec()
    }

    /// Streams `gen` after `prompt`; returns the deltas (including the final flush).
    fn stream(tok: &Arc<Tokenizer>, prompt: &[u32], gen_ids: &[u32]) -> Vec<String> {
        let mut dec = IncrementalDecoder::new(tok.clone(), prompt);
        let mut deltas = Vec::new();
        for &id in gen_ids {
            deltas.push(dec.push(id).unwrap());
        }
        deltas.push(dec.finish());
        deltas
    }

    #[test]
    fn ascii_roundtrip_tiny_tokenizer() {
        let tok = load(TINY);
        let prompt = encode(&tok, "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n");
        let gen_ids = encode(&tok, "The quick brown fox jumps over the lazy dog. 1234!");
        let deltas = stream(&tok, &prompt, &gen_ids);
        assert_eq!(deltas.concat(), tok.decode(&gen_ids, true).unwrap());
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
    }

    #[test]
    fn special_tokens_skipped() {
        let tok = load(SMOL);
        let mut gen_ids = encode(&tok, "Hi there");
        gen_ids.push(2); // <|im_end|>
        let deltas = stream(&tok, &[], &gen_ids);
        assert_eq!(deltas.concat(), "Hi there");
        assert_eq!(deltas[gen_ids.len() - 1], "", "a special token adds no text");
    }

    #[test]
    fn multibyte_never_emits_broken_utf8() {
        let tok = load(SMOL);
        let prompt = encode(&tok, "<|im_start|>user\nTranslate<|im_end|>\n<|im_start|>assistant\n");
        let text = "日本語のテキスト 😀👍🏽 — naïve café, 中文字符 🦀🚀 ∑∫ 한국어 🎉";
        let gen_ids = encode(&tok, text);
        // The fixture must actually contain characters split across tokens, or the test proves
        // nothing: some single token must decode to a replacement character on its own.
        let split_chars = gen_ids.iter().filter(|&&id| tok.decode(&[id], true).unwrap().contains('\u{FFFD}')).count();
        assert!(split_chars > 0, "no token of the fixture is a partial character");
        let deltas = stream(&tok, &prompt, &gen_ids);
        for d in &deltas {
            assert!(!d.contains('\u{FFFD}'), "delta with replacement char: {d:?}");
        }
        assert!(deltas.iter().any(|d| d.is_empty()), "some tokens must be held back");
        assert_eq!(deltas.concat(), tok.decode(&gen_ids, true).unwrap());
        assert_eq!(deltas.concat(), text);
    }

    #[test]
    fn generation_ending_inside_a_character_is_flushed() {
        let tok = load(SMOL);
        let gen_ids = encode(&tok, "ok 🦀");
        // Drop the last token so the emoji is incomplete.
        let cut = &gen_ids[..gen_ids.len() - 1];
        assert!(tok.decode(cut, true).unwrap().ends_with('\u{FFFD}'));
        let mut dec = IncrementalDecoder::new(tok.clone(), &[]);
        let mut streamed = String::new();
        for &id in cut {
            streamed.push_str(&dec.push(id).unwrap());
        }
        assert!(!streamed.contains('\u{FFFD}'));
        let rest = dec.finish();
        assert!(rest.ends_with('\u{FFFD}'));
        assert_eq!(streamed + &rest, tok.decode(cut, true).unwrap());
        assert_eq!(dec.finish(), "", "finish is idempotent");
    }

    #[test]
    fn leading_space_after_prompt_byte_level() {
        let tok = load(SMOL);
        let prompt = encode(&tok, "The answer is");
        let full = encode(&tok, "The answer is forty two");
        assert_eq!(&full[..prompt.len()], &prompt[..]);
        let gen_ids = &full[prompt.len()..];
        let deltas = stream(&tok, &prompt, gen_ids);
        assert_eq!(deltas[0], " forty");
        assert_eq!(deltas.concat(), " forty two");
    }

    /// A Metaspace (SentencePiece-style) tokenizer strips the leading space of the first token
    /// in a decoded slice, so decoding generated tokens on their own loses the space between
    /// prompt and completion; decoding in the context of the prompt keeps it.
    #[test]
    fn leading_space_after_prompt_metaspace() {
        let json = r#"{
          "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
          "normalizer": null,
          "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": true},
          "post_processor": null,
          "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": true},
          "model": {"type": "WordLevel", "unk_token": "<unk>",
                    "vocab": {"<unk>": 0, "\u2581Hi": 1, "\u2581Hello": 2, "\u2581world": 3, "!": 4}}
        }"#;
        let tok: Arc<Tokenizer> = Arc::new(json.parse().unwrap());
        let prompt = [1u32];
        let gen_ids = [2u32, 3, 4];
        assert_eq!(tok.decode(&gen_ids, true).unwrap(), "Hello world!");
        let deltas = stream(&tok, &prompt, &gen_ids);
        let all = tok.decode(&[1, 2, 3, 4], true).unwrap();
        let prompt_text = tok.decode(&prompt, true).unwrap();
        assert_eq!(deltas.concat(), all[prompt_text.len()..]);
        assert_eq!(deltas.concat(), " Hello world!");
        // Without a prompt the first token is decoded as the start of the text.
        assert_eq!(stream(&tok, &[], &gen_ids).concat(), "Hello world!");
    }

    #[test]
    fn prompt_ending_mid_character() {
        let tok = load(SMOL);
        let ids = encode(&tok, "x🦀y");
        // Find a cut inside the emoji: prefix decodes with a trailing replacement char.
        let cut = (1..ids.len())
            .find(|&i| tok.decode(&ids[..i], true).unwrap().ends_with('\u{FFFD}'))
            .expect("emoji spans tokens");
        let deltas = stream(&tok, &ids[..cut], &ids[cut..]);
        let text = deltas.concat();
        assert!(!text.contains('\u{FFFD}'));
        assert!(text.ends_with('y'), "{text:?}");
    }

    #[test]
    fn long_generation_matches_full_decode() {
        let tok = load(SMOL);
        let text = "Rust 🦀 is fast. ".repeat(50) + "Ünïcödé ✓ 完成";
        let gen_ids = encode(&tok, &text);
        let deltas = stream(&tok, &[], &gen_ids);
        assert_eq!(deltas.concat(), text);
    }
}
