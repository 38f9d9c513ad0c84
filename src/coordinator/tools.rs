//! Tool calling: checking the tools and tool choice a request gives, and finding the calls in a
//! model's output.
//!
//! Output follows the Hermes convention that Qwen2.5, Qwen3 and many fine-tunes are trained on
//! (their chat templates teach it) and that vLLM's `hermes` parser reads: plain content first,
//! then each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. As in vLLM,
//! output whose calls do not parse is returned whole as content, and a call's arguments are
//! returned as `json.dumps` text of the model's object, key order kept.

use minijinja::Value;

use super::pyjson;

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// Whether the output is searched for calls: OpenAI's `tool_choice`, of which this server
/// implements the two that need no constrained decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    /// plain text out (the tools are still rendered into the prompt, as vLLM does)
    None,
    /// the model decides; calls it makes are returned as tool calls
    Auto,
}

impl ToolChoice {
    /// Reads OpenAI's `tool_choice` (a string or `{"type": "function", ...}`); absent means
    /// `auto` when tools are given and `none` otherwise.
    pub fn parse(value: Option<&serde_json::Value>, has_tools: bool) -> Result<Self, String> {
        let choice = match value.and_then(serde_json::Value::as_str) {
            None if value.is_none() => return Ok(if has_tools { Self::Auto } else { Self::None }),
            Some("none") => Self::None,
            Some("auto") => Self::Auto,
            Some("required") | None => {
                return Err("tool_choice \"required\" or a named function needs constrained decoding, which this server \
                     does not implement; use \"auto\" (the model decides) or \"none\""
                    .into());
            }
            Some(other) => return Err(format!("tool_choice \"{other}\" is not one of none, auto, required")),
        };
        if choice == Self::Auto && !has_tools {
            return Err("tool_choice \"auto\" needs tools".into());
        }
        Ok(choice)
    }
}

/// Checks that `tools` is what templates expect: an array of `{"type": "function", "function":
/// {"name": ..., ...}}`. Returns a message naming the element at fault.
pub fn check_tools(tools: &Value) -> Result<(), String> {
    let items = tools.try_iter().ok().filter(|_| tools.kind() == minijinja::value::ValueKind::Seq);
    let Some(items) = items else {
        return Err("tools must be an array of {\"type\": \"function\", \"function\": {...}} objects".into());
    };
    for (i, tool) in items.enumerate() {
        let kind = tool.get_attr("type").ok();
        if kind.as_ref().and_then(Value::as_str) != Some("function") {
            return Err(format!("tools[{i}].type must be \"function\""));
        }
        let name = tool.get_attr("function").and_then(|f| f.get_attr("name")).ok();
        if name.as_ref().and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(format!("tools[{i}].function.name is required (a string)"));
        }
    }
    Ok(())
}

/// A call found in the output, in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// `chatcmpl-tool-` and 32 random hex digits, as vLLM names them
    pub id: String,
    pub name: String,
    /// the arguments object as JSON text
    pub arguments: String,
}

/// A whole output split into content and calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub content: String,
    pub calls: Vec<Call>,
}

/// Splits a finished output into content and calls.
pub fn parse(text: &str) -> Output {
    let Some(start) = text.find(START) else {
        return Output { content: text.to_owned(), calls: Vec::new() };
    };
    match parse_calls(&text[start..]) {
        Some(calls) => Output { content: text[..start].to_owned(), calls },
        None => Output { content: text.to_owned(), calls: Vec::new() },
    }
}

/// Parses `<tool_call>…</tool_call>` blocks (the last may lack its end tag: the output was cut
/// at EOS or a stop); `None` if any block is not a call.
fn parse_calls(mut text: &str) -> Option<Vec<Call>> {
    let mut calls = Vec::new();
    while let Some(start) = text.find(START) {
        let body = &text[start + START.len()..];
        let (json, rest) = body.split_once(END).unwrap_or((body, ""));
        calls.push(parse_call(json.trim())?);
        text = rest;
    }
    Some(calls)
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

/// Splits a streamed output as it arrives: content is passed on as soon as it cannot be the
/// start of a call; from the first `<tool_call>` on, the text is held until the end, when it is
/// parsed (or, if it does not parse, sent as content after all).
#[derive(Debug, Default)]
pub struct StreamParser {
    text: String,
    /// bytes of `text` already passed on as content
    sent: usize,
    in_calls: bool,
}

impl StreamParser {
    /// Adds a text delta; returns the content that can be sent now.
    pub fn push(&mut self, delta: &str) -> String {
        self.text.push_str(delta);
        if self.in_calls {
            return String::new();
        }
        let unsent = &self.text[self.sent..];
        let ready = match unsent.find(START) {
            Some(start) => {
                self.in_calls = true;
                start
            }
            // Hold back a tail that may be the first bytes of "<tool_call>" (ASCII, so the cut
            // is on a character boundary).
            None => unsent.len() - (1..START.len()).rev().find(|&n| unsent.ends_with(&START[..n])).unwrap_or(0),
        };
        let out = unsent[..ready].to_owned();
        self.sent += ready;
        out
    }

    /// The end of the output: content not yet sent, and the calls.
    pub fn finish(self) -> Output {
        let rest = &self.text[self.sent..];
        if self.in_calls {
            if let Some(calls) = parse_calls(rest) {
                return Output { content: String::new(), calls };
            }
        }
        Output { content: rest.to_owned(), calls: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_and_calls_are_split_and_arguments_keep_their_order() {
        let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let out = parse(text);
        assert_eq!(out.content, "Let me check.");
        assert_eq!(out.calls.len(), 2);
        assert_eq!((out.calls[0].name.as_str(), out.calls[0].arguments.as_str()), ("get_weather", r#"{"city": "Paris", "unit": "c"}"#));
        assert_eq!((out.calls[1].name.as_str(), out.calls[1].arguments.as_str()), ("now", "{}"));
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
    }

    #[test]
    fn streaming_holds_back_what_may_be_a_call() {
        let mut parser = StreamParser::default();
        assert_eq!(parser.push("Sure <"), "Sure ");
        assert_eq!(parser.push("b> and <tool"), "<b> and ");
        assert_eq!(parser.push("_call>\n{\"name\": \"f\", "), "");
        assert_eq!(parser.push("\"arguments\": {\"x\": 1}}\n</tool_call>"), "");
        let out = parser.finish();
        assert_eq!((out.content.as_str(), out.calls.len(), out.calls[0].arguments.as_str()), ("", 1, r#"{"x": 1}"#));
        let mut parser = StreamParser::default();
        assert_eq!(parser.push("a <tool_call>oops"), "a ");
        assert_eq!(parser.finish().content, "<tool_call>oops");
        let mut parser = StreamParser::default();
        assert_eq!(parser.push("ends with <tool_c"), "ends with ");
        assert_eq!(parser.finish().content, "<tool_c");
    }

    #[test]
    fn tool_choice_and_tools_are_checked() {
        use serde_json::json;
        assert_eq!(ToolChoice::parse(None, true), Ok(ToolChoice::Auto));
        assert_eq!(ToolChoice::parse(None, false), Ok(ToolChoice::None));
        assert_eq!(ToolChoice::parse(Some(&json!("none")), true), Ok(ToolChoice::None));
        assert!(ToolChoice::parse(Some(&json!("required")), true).unwrap_err().contains("constrained decoding"));
        assert!(ToolChoice::parse(Some(&json!({"type": "function", "function": {"name": "f"}})), true).is_err());
        assert!(ToolChoice::parse(Some(&json!("auto")), false).unwrap_err().contains("needs tools"));
        let ok = pyjson::parse(r#"[{"type": "function", "function": {"name": "f", "parameters": {}}}]"#).unwrap();
        assert_eq!(check_tools(&ok), Ok(()));
        assert!(check_tools(&pyjson::parse(r#"{"type": "function"}"#).unwrap()).unwrap_err().contains("array"));
        assert!(check_tools(&pyjson::parse(r#"[{"type": "retrieval"}]"#).unwrap()).unwrap_err().contains("tools[0].type"));
        assert!(check_tools(&pyjson::parse(r#"[{"type": "function", "function": {}}]"#).unwrap()).unwrap_err().contains("name"));
    }
}
