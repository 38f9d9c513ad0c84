//! The real Qwen3 tokenizer and chat template (tests/fixtures/qwen3_chat) and transformers'
//! renderings of its conversations: tools, a tool round trip, `enable_thinking`.

use std::path::PathBuf;

use minijinja::Value as TemplateValue;
use tpserve::coordinator::chat_template::{ChatMessage, FunctionCall, TemplateInputs, ToolCall};
use tpserve::coordinator::pyjson;

pub fn oracle_dir() -> PathBuf {
    super::fixture("qwen3_chat")
}

/// The oracle's cases, parsed into template values so that maps keep their order.
pub fn oracle() -> TemplateValue {
    pyjson::parse(&std::fs::read_to_string(oracle_dir().join("expected.json")).unwrap()).unwrap()
}

pub fn case(name: &str) -> TemplateValue {
    let cases = oracle().get_attr("cases").unwrap();
    cases.try_iter().unwrap().find(|c| c.get_attr("name").unwrap().as_str() == Some(name)).unwrap()
}

pub fn text(value: &TemplateValue, key: &str) -> Option<String> {
    value.get_attr(key).ok().and_then(|v| v.as_str().map(str::to_owned))
}

pub fn reference_ids(case: &TemplateValue) -> Vec<u32> {
    case.get_attr("ids").unwrap().try_iter().unwrap().map(|id| u32::try_from(id).unwrap()).collect()
}

pub fn messages(case: &TemplateValue) -> Vec<ChatMessage> {
    let messages = case.get_attr("messages").unwrap();
    messages
        .try_iter()
        .unwrap()
        .map(|m| {
            // An assistant turn that only calls tools may have no content.
            let mut message = ChatMessage::new(text(&m, "role").unwrap(), text(&m, "content").unwrap_or_default());
            if let Ok(calls) = m.get_attr("tool_calls").and_then(|c| c.try_iter().map(|i| i.collect::<Vec<_>>())) {
                message.tool_calls = calls
                    .iter()
                    .map(|call| {
                        let function = call.get_attr("function").unwrap();
                        let (name, arguments) = (text(&function, "name").unwrap(), function.get_attr("arguments").unwrap());
                        ToolCall { id: String::new(), kind: "function".into(), function: FunctionCall { name, arguments } }
                    })
                    .collect();
            }
            message
        })
        .collect()
}

pub fn inputs(case: &TemplateValue) -> TemplateInputs {
    let tools = case.get_attr("tools").ok().filter(|t| !t.is_undefined());
    let kwargs = case.get_attr("kwargs").unwrap();
    let kwargs = kwargs.try_iter().unwrap().map(|k| (k.to_string(), kwargs.get_item(&k).unwrap())).collect();
    TemplateInputs { tools, kwargs }
}

pub const CASES: [&str; 5] = ["plain", "no_thinking", "tools", "tool_round_trip", "multi_turn_thinking"];
