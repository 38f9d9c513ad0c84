//! Reads Hermes/Qwen `<tool_call>` blocks out of a model's output as it arrives, one text delta
//! at a time; a whole output is read as one delta. Content is passed on as soon as it cannot be
//! the start of a call; a block's text is held until its end tag, then parsed, and the call (or,
//! if the block is not a call, its raw text as content) is passed on at once. So a streamed
//! call reaches the client when its block closes, and the whole and streamed readings of an
//! output are the same by construction.
//!
//! As in vLLM, a call's arguments are returned as `json.dumps` text of the model's object, key
//! order kept. Unlike vLLM's whole-output reading, which turns every call back into content when
//! one block does not parse, each block stands alone: a streamed call already sent cannot be
//! taken back.

use super::{Call, END, START};
use crate::coordinator::pyjson;

/// What a piece of output adds: content to pass on, and the calls whose blocks closed in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    pub content: String,
    pub calls: Vec<Call>,
}

impl Output {
    pub fn append(&mut self, other: Output) {
        self.content.push_str(&other.content);
        self.calls.extend(other.calls);
    }
}

/// The reading state of one output.
#[derive(Debug, Default)]
pub struct StreamParser {
    /// text received and neither passed on nor parsed yet: inside a block, the block so far
    /// from its start tag; outside, a tail that may begin a start tag, or whitespace after a call
    pending: String,
    in_block: bool,
    /// calls found so far
    calls: usize,
}

impl StreamParser {
    /// A parser that has already read `prefix`, the forced opening of a call
    /// ([`super::ToolChoice::forced_prefix`]): the model's output continues the block.
    pub fn with_prefix(prefix: &str) -> Self {
        let mut parser = Self::default();
        // The prefix starts with the start tag, so it yields nothing.
        let _ = parser.push(prefix);
        parser
    }

    /// How many calls have been found.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads a text delta; returns what can be passed on now.
    pub fn push(&mut self, delta: &str) -> Output {
        self.pending.push_str(delta);
        let mut out = Output::default();
        loop {
            if self.in_block {
                let Some(end) = self.pending.find(END) else { break };
                let block: String = self.pending.drain(..end + END.len()).collect();
                self.in_block = false;
                self.read_block(&block[..end], &block, &mut out);
            } else if let Some(start) = self.pending.find(START) {
                let before: String = self.pending.drain(..start).collect();
                self.pass(&before, &mut out);
                self.in_block = true;
            } else {
                // Hold back a tail that may be the first bytes of the start tag (ASCII, so the
                // cut is on a character boundary), and whitespace after a call, which is dropped
                // if nothing but another call or the end follows (models put newlines between
                // calls).
                let tail = (1..START.len()).rev().find(|&n| self.pending.ends_with(&START[..n])).unwrap_or(0);
                let ready = self.pending.len() - tail;
                if !self.separates_calls(&self.pending[..ready]) {
                    let text: String = self.pending.drain(..ready).collect();
                    out.content.push_str(&text);
                }
                break;
            }
        }
        out
    }

    /// The end of the output: held text as content, a block cut off before its end tag (at EOS,
    /// a stop string or max_tokens) read as it is.
    pub fn finish(&mut self) -> Output {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Output::default();
        if self.in_block {
            self.in_block = false;
            self.read_block(&rest, &rest, &mut out);
        } else {
            self.pass(&rest, &mut out);
        }
        out
    }

    /// Passes on text outside blocks, unless it only separates calls.
    fn pass(&self, text: &str, out: &mut Output) {
        if !self.separates_calls(text) {
            out.content.push_str(text);
        }
    }

    fn separates_calls(&self, text: &str) -> bool {
        self.calls > 0 && text.trim().is_empty()
    }

    /// `body` is the block from its start tag to its end tag (or the output's end), `raw` the
    /// whole block as written.
    fn read_block(&mut self, body: &str, raw: &str, out: &mut Output) {
        match parse_call(body.strip_prefix(START).unwrap_or(body).trim()) {
            Some(call) => {
                self.calls += 1;
                out.calls.push(call);
            }
            None => out.content.push_str(raw),
        }
    }
}

/// Reads a whole output.
pub fn parse(text: &str) -> Output {
    let mut parser = StreamParser::default();
    let mut out = parser.push(text);
    out.append(parser.finish());
    out
}

fn parse_call(json: &str) -> Option<Call> {
    let call = pyjson::parse(json).ok()?;
    let name = call.get_attr("name").ok()?.as_str()?.to_owned();
    let arguments = call.get_attr("arguments").ok().filter(|a| !a.is_undefined())?;
    Some(Call { id: call_id(), name, arguments: pyjson::dumps(&arguments).ok()? })
}

fn call_id() -> String {
    let bytes: [u8; 16] = rand::random();
    format!("chatcmpl-tool-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(out: &Output, i: usize) -> (&str, &str) {
        (out.calls[i].name.as_str(), out.calls[i].arguments.as_str())
    }

    #[test]
    fn content_and_calls_are_split_and_arguments_keep_their_order() {
        let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n";
        let out = parse(text);
        assert_eq!(out.content, "Let me check.");
        assert_eq!(out.calls.len(), 2);
        assert_eq!(call(&out, 0), ("get_weather", r#"{"city": "Paris", "unit": "c"}"#));
        assert_eq!(call(&out, 1), ("now", "{}"));
        assert!(out.calls[0].id.starts_with("chatcmpl-tool-") && out.calls[0].id != out.calls[1].id);
    }

    #[test]
    fn output_that_is_not_a_call_stays_content() {
        for text in ["no calls here", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>", "x<tool_call>{\"name\": \"f\"}"] {
            assert_eq!(parse(text), Output { content: text.into(), calls: Vec::new() }, "{text}");
        }
        // cut off before its end tag (EOS, a stop string): still a call
        let out = parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, null, \"é\"]}}\n");
        assert_eq!(out.calls[0].arguments, r#"{"a": [1, 2.5, null, "é"]}"#);
        // Each block stands alone; text after a call that is more than a separator is content.
        let out = parse("<tool_call>{oops}</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n\nDone.\n");
        assert_eq!(out.content, "<tool_call>{oops}</tool_call>\n\n\nDone.\n");
        assert_eq!(call(&out, 0), ("f", "{}"));
    }

    /// Content streams as it comes, held back only where it may start a tag; a call is passed
    /// on with the delta that closes its block; the end flushes what was held.
    #[test]
    fn streaming_passes_each_call_when_its_block_closes() {
        let mut parser = StreamParser::default();
        assert_eq!(parser.push("Sure <").content, "Sure ");
        assert_eq!(parser.push("b> and <tool").content, "<b> and ");
        assert_eq!(parser.push("_call>\n{\"name\": \"f\", "), Output::default());
        let first = parser.push("\"arguments\": {\"x\": 1}}\n</tool_call>\n");
        assert_eq!((first.content.as_str(), call(&first, 0)), ("", ("f", r#"{"x": 1}"#)));
        assert_eq!(parser.push("<tool_call>{\"name\": \"g\", \"arguments\": {}}"), Output::default());
        let second = parser.push("</tool_call>");
        assert_eq!(call(&second, 0), ("g", "{}"));
        assert_eq!(parser.finish(), Output::default());
        assert_eq!(parser.calls(), 2);
        let mut parser = StreamParser::default();
        assert_eq!(parser.push("a <tool_call>oops").content, "a ");
        assert_eq!(parser.finish().content, "<tool_call>oops");
        let mut parser = StreamParser::default();
        assert_eq!(parser.push("ends with <tool_c").content, "ends with ");
        assert_eq!(parser.finish().content, "<tool_c");
        // A forced opening: the output continues the call.
        let mut parser = StreamParser::with_prefix("<tool_call>\n{\"name\": \"");
        assert_eq!(parser.push("f\", \"arguments\": {}}"), Output::default());
        assert_eq!(call(&parser.finish(), 0), ("f", "{}"));
    }
}
