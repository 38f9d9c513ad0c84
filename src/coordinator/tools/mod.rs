//! Tool calling: checking the tools and tool choice a request gives, and reading the calls in a
//! model's output.
//!
//! Output follows the Hermes convention that Qwen2.5, Qwen3 and many fine-tunes are trained on
//! (their chat templates teach it) and that vLLM's `hermes` parser reads: plain content first,
//! then each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. One parser
//! ([`parser`]) reads it, whole or as it streams, and one stream adapter ([`stream`]) applies it
//! to a choice's response stream for both public APIs, so gRPC and HTTP clients see the same
//! calls at the same points of the output.

pub mod parser;
pub mod stream;

use minijinja::Value;

pub use parser::{Output, StreamParser, parse};

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

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

    /// Whether the output is read for calls.
    pub fn reads_calls(&self) -> bool {
        *self != Self::None
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::pyjson;

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
