//! The OpenAI request bodies, read field by field so that a field of the wrong type is named in
//! the error, and a field this server does not implement is refused rather than ignored.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::HttpError;
use crate::coordinator::chat_template::{ChatMessage, TemplateInputs};
use crate::coordinator::error::Error;
use crate::coordinator::service::{self, MAX_CHOICES};
use crate::coordinator::tools::{self, ToolChoice};
use crate::proto::v1 as pb;
/// Most prompts one completions request may carry.
pub const MAX_PROMPTS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

#[derive(Debug)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Debug)]
pub enum Prompts {
    Chat { messages: Vec<ChatMessage>, inputs: TemplateInputs },
    Completion(Vec<PromptInput>),
}

/// A parsed request: what to prompt with, how to sample, how to answer.
#[derive(Debug)]
pub struct Parsed {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompts: Prompts,
    pub params: pb::GenerationParams,
    /// choices per prompt, each its own sequence
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// chat: whether the output is read for tool calls, and whether a call is forced
    pub tool_choice: ToolChoice,
}

impl Parsed {
    /// Whether the response carries logprobs.
    pub fn logprobs(&self) -> bool {
        self.params.logprobs
    }
}

/// The fields of a JSON object not yet read.
struct Fields(Map<String, Value>);

impl Fields {
    /// Takes a field; null counts as absent.
    fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, HttpError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => serde_json::from_value(value)
                .map(Some)
                .map_err(|err| HttpError::param(Error::invalid(format!("{name}: {err}")), name)),
        }
    }

    fn take_raw(&mut self, name: &str) -> Option<Value> {
        self.0.remove(name).filter(|v| !v.is_null())
    }

    /// Refuses any field left over (null ones excepted): unknown, or not implemented here.
    fn finish(self, what: &str) -> Result<(), HttpError> {
        match self.0.into_iter().find(|(_, v)| !v.is_null()) {
            None => Ok(()),
            Some((name, _)) => Err(HttpError::param(
                Error::invalid(format!("{what}: the field \"{name}\" is not supported by this server")),
                &name,
            )),
        }
    }
}

fn invalid(param: &str, message: impl Into<String>) -> HttpError {
    HttpError::param(Error::invalid(message), param)
}

/// Parses a request body of `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Parsed, HttpError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|err| HttpError::from(Error::invalid(format!("the body is not valid JSON: {err}"))))?;
    let Value::Object(map) = value else {
        return Err(Error::invalid("the body must be a JSON object").into());
    };
    let mut fields = Fields(map);
    let model: String = fields.take("model")?.unwrap_or_default();
    let mut params = pb::GenerationParams {
        max_tokens: fields.take("max_tokens")?,
        temperature: fields.take("temperature")?,
        top_p: fields.take("top_p")?,
        top_k: top_k(fields.take("top_k")?)?,
        min_p: fields.take("min_p")?,
        repetition_penalty: fields.take("repetition_penalty")?,
        presence_penalty: fields.take("presence_penalty")?,
        frequency_penalty: fields.take("frequency_penalty")?,
        seed: fields.take("seed")?,
        stop: stop(fields.take_raw("stop"))?,
        ignore_eos: fields.take("ignore_eos")?.unwrap_or(false),
        logprobs: false,
        top_logprobs: 0,
    };
    let n: u32 = fields.take("n")?.unwrap_or(1);
    if n == 0 || n > MAX_CHOICES {
        return Err(invalid("n", format!("n must be between 1 and {MAX_CHOICES}")));
    }
    let stream: bool = fields.take("stream")?.unwrap_or(false);
    let include_usage = match fields.take_raw("stream_options") {
        None => false,
        Some(options) => {
            if !stream {
                return Err(invalid("stream_options", "stream_options is only allowed with stream: true"));
            }
            let Value::Object(options) = options else {
                return Err(invalid("stream_options", "stream_options must be an object"));
            };
            let mut options = Fields(options);
            let include: Option<bool> = options.take("include_usage")?;
            options.finish("stream_options")?;
            include.unwrap_or(false)
        }
    };
    // An end-user id for abuse monitoring: it does not change the output.
    let _user: Option<String> = fields.take("user")?;
    let mut tool_choice = ToolChoice::None;
    let prompts = match endpoint {
        Endpoint::Chat => {
            let max_completion_tokens: Option<u32> = fields.take("max_completion_tokens")?;
            if max_completion_tokens.is_some() {
                params.max_tokens = max_completion_tokens;
            }
            let logprobs: bool = fields.take("logprobs")?.unwrap_or(false);
            let top_logprobs: Option<u32> = fields.take("top_logprobs")?;
            if top_logprobs.is_some() && !logprobs {
                return Err(invalid("top_logprobs", "top_logprobs requires logprobs: true"));
            }
            params.logprobs = logprobs;
            params.top_logprobs = top_logprobs.unwrap_or(0);
            let inputs = template_inputs(&mut fields, body)?;
            tool_choice = ToolChoice::parse(fields.take_raw("tool_choice").as_ref(), inputs.tools.as_ref())
                .map_err(|message| invalid("tool_choice", message))?;
            // vLLM's parallel_tool_calls: every call the model makes is returned either way.
            let _parallel: Option<bool> = fields.take("parallel_tool_calls")?;
            let Some(Value::Array(items)) = fields.take_raw("messages") else {
                return Err(invalid("messages", "messages is required: an array of {role, content} objects"));
            };
            let messages = items.into_iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<_, _>>()?;
            Prompts::Chat { messages, inputs }
        }
        Endpoint::Completion => {
            let logprobs: Option<u32> = fields.take("logprobs")?;
            params.logprobs = logprobs.is_some();
            params.top_logprobs = logprobs.unwrap_or(0);
            if fields.take::<bool>("echo")?.unwrap_or(false) {
                return Err(invalid("echo", "echo is not supported by this server"));
            }
            match fields.take::<u32>("best_of")? {
                Some(best_of) if best_of != n => {
                    return Err(invalid("best_of", "best_of is not supported by this server (only best_of equal to n)"));
                }
                _ => {}
            }
            let prompt = fields.take_raw("prompt").ok_or_else(|| invalid("prompt", "prompt is required"))?;
            Prompts::Completion(prompt_inputs(prompt)?)
        }
    };
    let what = match endpoint {
        Endpoint::Chat => "chat completions",
        Endpoint::Completion => "completions",
    };
    fields.finish(what)?;
    Ok(Parsed { endpoint, model, prompts, params, n, stream, include_usage, tool_choice })
}

/// `tools` and `chat_template_kwargs`, checked on the parsed body, then read again from the
/// body's text as template values: those keep the client's key order, which is part of the
/// prompt (`tools | tojson`), where the parsed body's maps are sorted.
fn template_inputs(fields: &mut Fields, body: &[u8]) -> Result<TemplateInputs, HttpError> {
    #[derive(serde::Deserialize)]
    struct Ordered {
        #[serde(default)]
        tools: Option<minijinja::Value>,
        #[serde(default)]
        chat_template_kwargs: Option<std::collections::BTreeMap<String, minijinja::Value>>,
    }
    match fields.take_raw("chat_template_kwargs") {
        None | Some(Value::Object(_)) => {}
        Some(_) => return Err(invalid("chat_template_kwargs", "chat_template_kwargs must be an object")),
    }
    let has_tools = fields.take_raw("tools").is_some();
    let ordered: Ordered = serde_json::from_slice(body).map_err(|err| HttpError::from(Error::invalid(format!("the body: {err}"))))?;
    let tools = ordered.tools.filter(|_| has_tools);
    if let Some(tools) = &tools {
        tools::check_tools(tools).map_err(|message| invalid("tools", message))?;
    }
    Ok(TemplateInputs { tools, kwargs: ordered.chat_template_kwargs.unwrap_or_default() })
}

/// vLLM's top_k: 0 or -1 means no truncation.
fn top_k(value: Option<i64>) -> Result<Option<u32>, HttpError> {
    match value {
        None => Ok(None),
        Some(k) if k <= 0 => Ok(Some(0)),
        Some(k) => u32::try_from(k).map(Some).map_err(|_| invalid("top_k", "top_k is too large")),
    }
}

fn stop(value: Option<Value>) -> Result<Vec<String>, HttpError> {
    match value {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => Ok(s),
                _ => Err(invalid("stop", "stop must be a string or an array of strings")),
            })
            .collect(),
        Some(_) => Err(invalid("stop", "stop must be a string or an array of strings")),
    }
}

/// A completions prompt: a string, an array of token ids, or an array of either.
fn prompt_inputs(prompt: Value) -> Result<Vec<PromptInput>, HttpError> {
    const SHAPE: &str = "prompt must be a string, an array of token ids, or an array of strings or of token id arrays";
    let one = |value: Value| -> Result<PromptInput, HttpError> {
        match value {
            Value::String(s) => Ok(PromptInput::Text(s)),
            Value::Array(ids) => ids
                .into_iter()
                .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| invalid("prompt", SHAPE)))
                .collect::<Result<_, _>>()
                .map(PromptInput::Ids),
            _ => Err(invalid("prompt", SHAPE)),
        }
    };
    let inputs = match prompt {
        Value::Array(items) if items.first().is_some_and(|v| v.is_string() || v.is_array()) => {
            items.into_iter().map(one).collect::<Result<Vec<_>, _>>()?
        }
        Value::Array(items) if items.is_empty() => return Err(invalid("prompt", "prompt is empty")),
        other => vec![one(other)?],
    };
    if inputs.len() > MAX_PROMPTS {
        return Err(invalid("prompt", format!("at most {MAX_PROMPTS} prompts are accepted in one request")));
    }
    Ok(inputs)
}

/// One chat message: a role and text content (a string or text parts).
fn message(index: usize, value: Value) -> Result<ChatMessage, HttpError> {
    let param = format!("messages[{index}]");
    let Value::Object(map) = value else {
        return Err(invalid(&param, format!("{param} must be an object with role and content")));
    };
    let mut fields = Fields(map);
    let role: String = fields.take("role")?.ok_or_else(|| invalid(&param, format!("{param}.role is required")))?;
    if !matches!(role.as_str(), "system" | "user" | "assistant" | "tool") {
        return Err(invalid(&param, format!("{param}.role \"{role}\" is not one of system, user, assistant, tool")));
    }
    let content = content(&param, fields.take_raw("content"))?;
    let tool_calls = match fields.take_raw("tool_calls") {
        None => Vec::new(),
        Some(Value::Array(calls)) if role == "assistant" => {
            calls.into_iter().enumerate().map(|(j, call)| tool_call(&format!("{param}.tool_calls[{j}]"), call)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(invalid(&param, format!("{param}.tool_calls must be an array, on an assistant message"))),
    };
    let tool_call_id: Option<String> = fields.take("tool_call_id")?;
    let name: Option<String> = fields.take("name")?;
    fields.finish(&param)?;
    Ok(ChatMessage { role, content, tool_calls, tool_call_id, name })
}

/// A message's content: absent or null (an assistant turn that only calls tools), a string, or
/// text parts.
fn content(param: &str, value: Option<Value>) -> Result<String, HttpError> {
    match value {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("text", Some(text)) => texts.push(text.to_owned()),
                    _ => {
                        return Err(invalid(
                            param,
                            format!("{param}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, not \"{kind}\""),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(invalid(param, format!("{param}.content must be a string or an array of text parts"))),
    }
}

/// One call of an assistant message: `{id, type: "function", function: {name, arguments}}`,
/// the arguments a JSON object in text, as OpenAI returns them.
fn tool_call(field: &str, value: Value) -> Result<crate::coordinator::chat_template::ToolCall, HttpError> {
    let shape = || invalid(field, format!("{field} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"));
    let Value::Object(map) = value else { return Err(shape()) };
    let mut fields = Fields(map);
    let id: String = fields.take("id")?.unwrap_or_default();
    let kind: String = fields.take("type")?.unwrap_or_default();
    let Some(Value::Object(function)) = fields.take_raw("function") else { return Err(shape()) };
    fields.finish(field)?;
    let mut function = Fields(function);
    let name: String = function.take("name")?.unwrap_or_default();
    let arguments: String = function.take("arguments")?.unwrap_or_else(|| "{}".to_owned());
    function.finish(&format!("{field}.function"))?;
    service::tool_call(field, id, kind, name, &arguments).map_err(|err| HttpError::param(err, field))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(endpoint: Endpoint, body: &str) -> String {
        parse(endpoint, body.as_bytes()).unwrap_err().error.message
    }

    #[test]
    fn fields_are_read_and_unsupported_ones_refused() {
        let chat = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "max_completion_tokens":5,"temperature":0,"stop":"x","n":2,"logprobs":true,"top_logprobs":3,
            "stream":true,"stream_options":{"include_usage":true},"top_k":-1}"#;
        let parsed = parse(Endpoint::Chat, chat.as_bytes()).unwrap();
        assert_eq!(parsed.params.max_tokens, Some(5));
        assert_eq!(parsed.params.top_k, Some(0));
        assert_eq!(parsed.params.stop, ["x"]);
        assert!(parsed.include_usage && parsed.stream && parsed.logprobs());
        assert_eq!(parsed.n, 2);
        assert!(refusal(Endpoint::Chat, r#"{"messages":[],"logit_bias":{"1":2}}"#).contains("\"logit_bias\" is not supported"));
        assert!(refusal(Endpoint::Chat, r#"{"messages":[],"temperature":"hot"}"#).starts_with("temperature: "));
        assert!(refusal(Endpoint::Chat, r#"{"messages":[{"role":"robot","content":""}]}"#).contains("robot"));
        assert!(refusal(Endpoint::Completion, r#"{"prompt":"a","echo":true}"#).contains("echo"));
        assert!(refusal(Endpoint::Completion, r#"{"prompt":[1,-2]}"#).starts_with("prompt must be"));
        let parsed = parse(Endpoint::Completion, br#"{"prompt":[[1,2],[3]],"logprobs":2}"#).unwrap();
        assert!(matches!(&parsed.prompts, Prompts::Completion(p) if p.len() == 2));
        assert_eq!(parsed.params.top_logprobs, 2);
    }
}
