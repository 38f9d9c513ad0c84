//! Tool calling: checking the tools and tool choice a request gives, and reading the calls in a
//! model's output.
//!
//! Output follows the Hermes convention that Qwen2.5, Qwen3 and many fine-tunes are trained on
//! (their chat templates teach it) and that vLLM's `hermes` parser reads: plain content first,
//! then each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. One parser
//! ([`parser`]) reads it, whole or as it streams, and one stream adapter ([`stream`]) applies it
//! to a choice's response stream for both public APIs, so gRPC and HTTP clients see the same
//! calls at the same points of the output.
//!
//! `tool_choice` `required` and a named function are met by forcing the start of a call: the
//! call's opening is appended to the prompt after the template's generation prompt, and put back
//! in front of the output when it is read ([`ToolChoice::forced_prefix`]). That guarantees the
//! output starts as a call (of the named function), not that its arguments are valid JSON or
//! match the function's schema: this server has no constrained decoding.

pub mod parser;
pub mod stream;

use minijinja::Value;

use super::pyjson;
pub use parser::{Output, StreamParser, parse};

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// OpenAI's `tool_choice`: whether the output is read for calls, and whether a call is forced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// plain text out (the tools are still rendered into the prompt, as vLLM does)
    None,
    /// the model decides; calls it makes are returned as tool calls
    Auto,
    /// the output starts with a call; the model chooses the function
    Required,
    /// the output starts with a call of this function
    Function(String),
}

impl ToolChoice {
    /// Reads OpenAI's `tool_choice`: `"none"`, `"auto"`, `"required"`, or `{"type": "function",
    /// "function": {"name": ...}}` naming one of `tools`. Absent means `auto` when tools are
    /// given and `none` otherwise.
    pub fn parse(value: Option<&serde_json::Value>, tools: Option<&Value>) -> Result<Self, String> {
        let choice = match value {
            None => return Ok(if tools.is_some() { Self::Auto } else { Self::None }),
            Some(serde_json::Value::String(text)) => match text.as_str() {
                "none" => Self::None,
                "auto" => Self::Auto,
                "required" => Self::Required,
                other => return Err(format!("tool_choice \"{other}\" is not one of none, auto, required")),
            },
            Some(serde_json::Value::Object(object)) => {
                let name = (object.get("type").and_then(serde_json::Value::as_str) == Some("function"))
                    .then(|| object.get("function").and_then(|f| f.get("name")).and_then(serde_json::Value::as_str))
                    .flatten();
                let Some(name) = name.filter(|name| !name.is_empty()) else {
                    return Err("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}".into());
                };
                Self::Function(name.to_owned())
            }
            Some(_) => return Err("tool_choice must be a string or an object".into()),
        };
        match (&choice, tools) {
            (Self::None, _) => {}
            (_, None) => return Err("tool_choice other than \"none\" needs tools".into()),
            (Self::Function(name), Some(tools)) if !function_names(tools).any(|n| n == *name) => {
                let offered: Vec<String> = function_names(tools).collect();
                return Err(format!("tool_choice names the function \"{name}\", which is not in tools (they offer: {})", offered.join(", ")));
            }
            _ => {}
        }
        Ok(choice)
    }

    /// Whether the output is read for calls.
    pub fn reads_calls(&self) -> bool {
        *self != Self::None
    }

    /// The text that starts the assistant's turn when a call is forced: the opening of a call up
    /// to where the model must continue. It ends at a token boundary of Qwen's own tokenization
    /// of a call (`":` and ` "` are single tokens there), so the model continues as it would
    /// after writing it itself: `required` stops before the name, a named function before the
    /// space that starts the arguments.
    pub fn forced_prefix(&self) -> Option<String> {
        match self {
            Self::None | Self::Auto => None,
            Self::Required => Some(format!("{START}\n{{\"name\": \"")),
            Self::Function(name) => {
                let name = pyjson::dumps(&Value::from(name.as_str())).unwrap_or_else(|_| format!("\"{name}\""));
                Some(format!("{START}\n{{\"name\": {name}, \"arguments\":"))
            }
        }
    }
}

/// The function names of `tools` (already checked by [`check_tools`]).
fn function_names(tools: &Value) -> impl Iterator<Item = String> + '_ {
    tools.try_iter().into_iter().flatten().filter_map(|tool| {
        let name = tool.get_attr("function").and_then(|f| f.get_attr("name")).ok()?;
        name.as_str().map(str::to_owned)
    })
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
    use serde_json::json;

    use super::*;

    #[test]
    fn tool_choice_and_tools_are_checked() {
        let tools = pyjson::parse(r#"[{"type": "function", "function": {"name": "f", "parameters": {}}}, {"type": "function", "function": {"name": "g"}}]"#).unwrap();
        let parse = |value: serde_json::Value| ToolChoice::parse(Some(&value), Some(&tools));
        assert_eq!(ToolChoice::parse(None, Some(&tools)), Ok(ToolChoice::Auto));
        assert_eq!(ToolChoice::parse(None, None), Ok(ToolChoice::None));
        assert_eq!(parse(json!("none")), Ok(ToolChoice::None));
        assert_eq!(parse(json!("required")), Ok(ToolChoice::Required));
        assert_eq!(parse(json!({"type": "function", "function": {"name": "g"}})), Ok(ToolChoice::Function("g".into())));
        assert_eq!(parse(json!({"type": "function", "function": {"name": "h"}})).unwrap_err(), "tool_choice names the function \"h\", which is not in tools (they offer: f, g)");
        assert!(parse(json!({"type": "function"})).unwrap_err().contains("{\"type\": \"function\""));
        assert!(parse(json!("any")).unwrap_err().contains("not one of"));
        for choice in [json!("auto"), json!("required"), json!({"type": "function", "function": {"name": "f"}})] {
            assert!(ToolChoice::parse(Some(&choice), None).unwrap_err().contains("needs tools"), "{choice}");
        }
        assert_eq!(check_tools(&tools), Ok(()));
        assert!(check_tools(&pyjson::parse(r#"{"type": "function"}"#).unwrap()).unwrap_err().contains("array"));
        assert!(check_tools(&pyjson::parse(r#"[{"type": "retrieval"}]"#).unwrap()).unwrap_err().contains("tools[0].type"));
        assert!(check_tools(&pyjson::parse(r#"[{"type": "function", "function": {}}]"#).unwrap()).unwrap_err().contains("name"));
    }

    /// The forced openings, and the calls they make once the model's continuation is read
    /// behind them.
    #[test]
    fn forced_prefixes_open_a_call() {
        assert_eq!(ToolChoice::Auto.forced_prefix(), None);
        let required = ToolChoice::Required.forced_prefix().unwrap();
        assert_eq!(required, "<tool_call>\n{\"name\": \"");
        let named = ToolChoice::Function("récolte".into()).forced_prefix().unwrap();
        assert_eq!(named, "<tool_call>\n{\"name\": \"récolte\", \"arguments\":");
        let out = parse(&format!("{named} {{\"kg\": 3}}}}\n</tool_call>"));
        assert_eq!((out.content.as_str(), out.calls[0].name.as_str(), out.calls[0].arguments.as_str()), ("", "récolte", r#"{"kg": 3}"#));
        let out = parse(&format!("{required}f\", \"arguments\": {{}}}}\n</tool_call>"));
        assert_eq!(out.calls[0].name, "f");
    }
}
