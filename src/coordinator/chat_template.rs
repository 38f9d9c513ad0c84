//! Chat templates: turning a list of chat messages into the prompt string the model was
//! trained on.
//!
//! Models ship their template as Jinja2 source meant for Hugging Face transformers, so the goal
//! here is to render byte-for-byte what `tokenizer.apply_chat_template(..., tokenize=False)`
//! renders. minijinja is close to Jinja2 but not identical; the environment below adds what HF
//! adds (trim/lstrip blocks, `raise_exception`, `strftime_now`, a Python-compatible `tojson`)
//! and Python string/dict methods through `minijinja_contrib::pycompat`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, anyhow, bail};
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};
use serde::{Deserialize, Serialize};

use super::pyjson;

/// Name under which the single template is registered in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation as the template sees it (`message['role']`,
/// `message['content']`; for tool use `message['tool_calls']`, `message['tool_call_id']` and
/// `message['name']`). A field the message lacks is undefined in the template, as in
/// transformers, so `{% if message.tool_calls %}` works.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), tool_calls: Vec::new(), tool_call_id: None, name: None }
    }
}

/// A function call of an earlier assistant turn, as OpenAI clients send it back: `{id, type:
/// "function", function: {name, arguments}}`. The arguments are the parsed JSON value, not
/// OpenAI's JSON string: vLLM parses them before rendering too, so a template that writes
/// `arguments | tojson` prints them as transformers would.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: Value,
}

/// What a request adds to its conversation when rendering: the tools it offers (OpenAI function
/// definitions, the template's `tools`) and other template variables (HF's `**kwargs` to
/// `apply_chat_template`, e.g. Qwen3's `enable_thinking`). They are template values parsed from
/// the client's JSON text, so maps keep the client's key order (see [`pyjson`]).
#[derive(Debug, Clone, Default)]
pub struct TemplateInputs {
    pub tools: Option<Value>,
    pub kwargs: BTreeMap<String, Value>,
}

/// A compiled chat template plus the special tokens HF passes into every render.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// whether the template teaches Hermes-style calls (see [`ChatTemplate::writes_hermes_calls`])
    hermes_calls: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads the template the way transformers does for a model directory.
    ///
    /// Source precedence follows transformers: a standalone `chat_template.jinja` wins over
    /// `chat_template.json` (processor-style checkpoints), which wins over the `chat_template`
    /// entry of `tokenizer_config.json`. `Ok(None)` means the model has no template (a base
    /// model), which is not an error: callers can still serve plain completions.
    pub fn from_model_dir(dir: &Path) -> anyhow::Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("chat template: reading {}", config_path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("chat template: parsing {}", config_path.display()))?
        } else {
            serde_json::Value::Null
        };

        let jinja_path = dir.join("chat_template.jinja");
        let json_path = dir.join("chat_template.json");
        let source = if jinja_path.is_file() {
            Some(
                std::fs::read_to_string(&jinja_path)
                    .with_context(|| format!("chat template: reading {}", jinja_path.display()))?,
            )
        } else if json_path.is_file() {
            let text = std::fs::read_to_string(&json_path)
                .with_context(|| format!("chat template: reading {}", json_path.display()))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("chat template: parsing {}", json_path.display()))?;
            template_from_config_value(value.get("chat_template"))
                .with_context(|| format!("chat template: in {}", json_path.display()))?
        } else {
            template_from_config_value(config.get("chat_template"))
                .with_context(|| format!("chat template: in {}", config_path.display()))?
        };
        let Some(source) = source else {
            return Ok(None);
        };

        let bos_token = special_token(config.get("bos_token"));
        let eos_token = special_token(config.get("eos_token"));
        Self::new(source, bos_token, eos_token).map(Some)
    }

    /// Compiles a template from source. Useful when the template comes from somewhere other
    /// than a model directory (a command-line override).
    pub fn new(source: String, bos_token: Option<String>, eos_token: Option<String>) -> anyhow::Result<ChatTemplate> {
        let mut env = Environment::new();
        // HF compiles with trim_blocks=True, lstrip_blocks=True and Jinja2's default
        // keep_trailing_newline=False (one trailing newline of the source is dropped); templates
        // are written against exactly that whitespace handling.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // Jinja2's default Undefined: printing or testing a missing variable is fine, touching an
        // attribute of it is an error. Templates rely on `{% if tools %}` with tools absent.
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", pyjson::tojson);
        env.set_formatter(python_formatter);
        let hermes_calls = source.contains("<tool_call>") && !source.contains("<function=");
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| anyhow!("chat template error: template does not compile: {}", describe(&e)))?;
        Ok(ChatTemplate { env, bos_token, eos_token, hermes_calls })
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Whether the template teaches the model Hermes-style calls, `<tool_call>` around a JSON
    /// object (Qwen2.5, Qwen3, Hermes): it mentions the tag, and not the XML-style `<function=`
    /// calls Qwen3-Coder writes inside the same tag. A forced call is written in that format, so
    /// it is only forced on models that were taught it.
    pub fn writes_hermes_calls(&self) -> bool {
        self.hermes_calls
    }

    /// Renders a conversation. `add_generation_prompt` appends the assistant turn header so
    /// the model continues as the assistant.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> anyhow::Result<String> {
        self.render_with(messages, add_generation_prompt, &TemplateInputs::default())
    }

    /// Like [`render`](Self::render) with the request's tools and template variables.
    ///
    /// `messages`, `add_generation_prompt`, `bos_token` and `eos_token` always take the values
    /// this method sets, so a client cannot spoof the conversation through extra variables.
    pub fn render_with(&self, messages: &[ChatMessage], add_generation_prompt: bool, inputs: &TemplateInputs) -> anyhow::Result<String> {
        let mut ctx: BTreeMap<String, Value> = inputs.kwargs.clone();
        if let Some(tools) = &inputs.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        let template =
            self.env.get_template(TEMPLATE_NAME).map_err(|e| anyhow!("chat template error: {}", describe(&e)))?;
        template.render(ctx).map_err(|e| anyhow!("chat template error: {}", describe(&e)))
    }
}

/// Extracts the template source from a `chat_template` config entry.
///
/// Older tokenizer configs hold a list of named templates (`[{name, template}]`); HF uses the
/// one named "default" when no name is requested.
fn template_from_config_value(value: Option<&serde_json::Value>) -> anyhow::Result<Option<String>> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(items)) => {
            let mut names = Vec::new();
            for item in items {
                let name = item.get("name").and_then(|n| n.as_str()).unwrap_or("");
                if name == "default" {
                    return match item.get("template") {
                        Some(serde_json::Value::String(t)) => Ok(Some(t.clone())),
                        _ => bail!("named chat template \"default\" has no \"template\" string"),
                    };
                }
                names.push(name.to_owned());
            }
            bail!("chat_template is a list of named templates without one named \"default\" (found {names:?})")
        }
        Some(other) => bail!("chat_template must be a string or a list of named templates, found {other}"),
    }
}

/// Special tokens in tokenizer_config.json are either plain strings or AddedToken objects
/// (`{"content": "<s>", "lstrip": false, ...}`); templates only ever see the text.
fn special_token(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(obj) => obj.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// minijinja's Display for errors includes the template name and line; the detail alone
/// would hide where a long template failed.
fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        msg.push_str(": ");
        msg.push_str(&inner.to_string());
        source = inner.source();
    }
    msg
}

/// Jinja2 prints Python values: `True`/`False`/`None` and `['a', 1]`, where minijinja would
/// print `true`/`false`/`none` and `["a", 1]`. Templates that print flags or lists directly
/// must produce the prompt the model saw in training, so match Python.
fn python_formatter(out: &mut minijinja::Output, state: &minijinja::State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(value, &mut text);
            Ok(out.write_str(&text)?)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a template value (as `str()` of a container shows its items).
fn python_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            let Ok(items) = value.try_iter() else {
                out.push_str(&value.to_string());
                return;
            };
            out.push('[');
            for (i, item) in items.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let Ok(keys) = value.try_iter() else {
                out.push_str(&value.to_string());
                return;
            };
            out.push('{');
            for (i, key) in keys.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out);
                out.push_str(": ");
                python_repr(&value.get_item(&key).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's `repr` of a str: single quotes unless only double quotes avoid escaping.
fn python_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Templates validate conversations (e.g. "roles must alternate") by calling
/// `raise_exception`; the message is what the client needs to see.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// HF exposes `strftime_now(format)` so templates can stamp today's date (Llama 3.x system
/// prompts do). Time is UTC: a server has no meaningful local zone for its clients.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(&format, secs).map(Value::from)
}

/// The subset of C `strftime` that chat templates use, for a UTC Unix timestamp.
fn strftime(format: &str, unix_secs: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day % 3600 / 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        match spec {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:>2}")),
            '-' => match chars.next() {
                // glibc's "no padding" flag, common in templates (`%-d`).
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some('H') => out.push_str(&hour.to_string()),
                Some('I') => out.push_str(&(if hour % 12 == 0 { 12 } else { hour % 12 }).to_string()),
                Some('M') => out.push_str(&minute.to_string()),
                Some('S') => out.push_str(&second.to_string()),
                Some('j') => out.push_str(&day_of_year.to_string()),
                other => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("strftime_now: unsupported format %-{}", other.map(String::from).unwrap_or_default()),
                    ));
                }
            },
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", if hour % 12 == 0 { 12 } else { hour % 12 })),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'j' => out.push_str(&format!("{day_of_year:03}")),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'a' => out.push_str(&day_name[..3]),
            'A' => out.push_str(day_name),
            'F' => out.push_str(&format!("{year:04}-{month:02}-{day:02}")),
            'T' => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format %{other}"),
                ));
            }
        }
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    fn system_user() -> Vec<ChatMessage> {
        vec![msg("system", "You are a terse assistant."), msg("user", "What is 2+2?")]
    }

    /// A scratch model directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let unique = format!(
                "tpserve-chat-template-{tag}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
            );
            let path = std::env::temp_dir().join(unique);
            std::fs::create_dir_all(&path).unwrap();
            TempDir(path)
        }
        fn write(&self, name: &str, content: &str) {
            std::fs::write(self.0.join(name), content).unwrap();
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn render_src(src: &str, messages: &[ChatMessage], gen_prompt: bool) -> anyhow::Result<String> {
        ChatTemplate::new(src.to_owned(), Some("<s>".into()), Some("</s>".into()))?.render(messages, gen_prompt)
    }

    #[test]
    fn oracle_chatml_template() {
        let t = ChatTemplate::from_model_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_a")).unwrap().unwrap();
        assert_eq!(t.eos_token(), Some("<|im_end|>"));
        assert_eq!(t.bos_token(), None);
        let out = t.render(&system_user(), true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let out = t.render(&system_user(), false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        );
    }

    #[test]
    fn smollm2_template_from_jinja_file() {
        let t = ChatTemplate::from_model_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_135m")).unwrap().unwrap();
        assert_eq!(t.bos_token(), Some("<|im_start|>"));
        assert_eq!(t.eos_token(), Some("<|im_end|>"));
        let out = t.render(&system_user(), true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // Without a system message the template injects its default one.
        let out = t.render(&[msg("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn no_template_is_none() {
        let dir = TempDir::new("none");
        assert!(ChatTemplate::from_model_dir(&dir.0).unwrap().is_none());
        dir.write("tokenizer_config.json", r#"{"eos_token": "</s>"}"#);
        assert!(ChatTemplate::from_model_dir(&dir.0).unwrap().is_none());
    }

    #[test]
    fn named_templates_and_token_objects() {
        let dir = TempDir::new("named");
        dir.write(
            "tokenizer_config.json",
            r#"{
              "bos_token": {"content": "<s>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false},
              "eos_token": {"__type": "AddedToken", "content": "</s>"},
              "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"}
              ]
            }"#,
        );
        let t = ChatTemplate::from_model_dir(&dir.0).unwrap().unwrap();
        assert_eq!(t.render(&[msg("user", "x")], false).unwrap(), "<s>[user]x</s>");

        dir.write("tokenizer_config.json", r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#);
        let err = ChatTemplate::from_model_dir(&dir.0).unwrap_err();
        assert!(format!("{err:#}").contains("\"default\""), "{err:#}");
    }

    #[test]
    fn jinja_file_wins_over_config() {
        let dir = TempDir::new("precedence");
        dir.write("tokenizer_config.json", r#"{"chat_template": "CONFIG", "eos_token": "E"}"#);
        dir.write("chat_template.json", r#"{"chat_template": "JSON"}"#);
        let t = ChatTemplate::from_model_dir(&dir.0).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "JSON");
        // Jinja2 drops exactly one trailing newline of the source.
        dir.write("chat_template.jinja", "FILE{{ eos_token }}\n\n");
        let t = ChatTemplate::from_model_dir(&dir.0).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "FILEE\n");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        // With trim_blocks the newline after a block tag goes; with lstrip_blocks the
        // indentation before a block tag goes. Output tags keep their surroundings.
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    {% endif %}\n{% endfor %}\nEND\n";
        let out = render_src(src, &[msg("user", "a"), msg("assistant", "b")], false).unwrap();
        assert_eq!(out, "  U: a\nEND");
    }

    #[test]
    fn raise_exception_fails_with_message() {
        let src = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be first') }}{% endif %}{{ m.content }}{% endfor %}";
        let err = render_src(src, &[msg("user", "a"), msg("system", "b")], false).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("chat template error:"), "{text}");
        assert!(text.contains("System message must be first"), "{text}");
        assert_eq!(render_src(src, &[msg("system", "s"), msg("user", "u")], false).unwrap(), "su");
    }

    #[test]
    fn python_methods_and_hf_idioms() {
        let src = "{{ messages[0]['content'].strip() }}|{{ messages[0].content.startswith('  hi') }}|\
                   {{ messages[0].content.split()|join(',') }}|{{ 'x' if tools is not defined else 'y' }}|\
                   {% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|\
                   {{ messages[0].content is string }}";
        let out = render_src(src, &[msg("user", "  hi there  ")], false).unwrap();
        assert_eq!(out, "hi there|True|hi,there|x|1|True");
        // Python's rendering of None and booleans.
        assert_eq!(
            render_src("{{ none }}|{{ false }}|{{ undefined_var }}|{{ 1 == 1 }}", &[], false).unwrap(),
            "None|False||True"
        );
        // str() of Python containers: repr of the items.
        assert_eq!(
            render_src(
                r#"{{ ['a', 1, 2.5, none, true, "it's", 'q"\n'] }}|{{ {'k': ['v']} }}|{{ 'a b'.split() }}"#,
                &[],
                false
            )
            .unwrap(),
            r#"['a', 1, 2.5, None, True, "it's", 'q"\n']|{'k': ['v']}|['a', 'b']"#
        );
    }

    #[test]
    fn extra_variables_and_reserved_names() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{{ messages|length }}";
        let t = ChatTemplate::new(src.into(), None, None).unwrap();
        let mut extra = TemplateInputs::default();
        extra.kwargs.insert("enable_thinking".into(), Value::from(false));
        extra.kwargs.insert("messages".into(), Value::from(vec![1, 2, 3, 4, 5]));
        assert_eq!(t.render_with(&[msg("user", "q")], true, &extra).unwrap(), "<think>\n\n</think>\n\n1");
        assert_eq!(t.render(&[msg("user", "q")], true).unwrap(), "1");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = |src: &str| render_src(src, &[], false).unwrap();
        // json.dumps(["x", 1, None, True, 1.5, "é<&>'"], ensure_ascii=False)
        assert_eq!(t(r#"{{ ["x", 1, none, true, 1.5, "é<&>'"] | tojson }}"#), r#"["x", 1, null, true, 1.5, "é<&>'"]"#);
        // json.dumps({"k": {"a": [1, 2], "b": {}}}, indent=2)
        assert_eq!(
            t(r#"{{ {"k": {"a": [1, 2], "b": {}, "c": []}} | tojson(indent=2) }}"#),
            "{\n  \"k\": {\n    \"a\": [\n      1,\n      2\n    ],\n    \"b\": {},\n    \"c\": []\n  }\n}"
        );
        assert_eq!(t(r#"{{ {"a": "é😀"} | tojson(ensure_ascii=true) }}"#), r#"{"a": "\u00e9\ud83d\ude00"}"#);
        assert_eq!(t(r#"{{ {"a": [1, 2]} | tojson(separators=(",", ":")) }}"#), r#"{"a":[1,2]}"#);
        assert_eq!(t(r#"{{ "line\nbreak" | tojson }}"#), r#""line\nbreak""#);
    }

    #[test]
    fn compile_error_is_reported() {
        let err = ChatTemplate::new("{% for m in messages %}".into(), None, None).unwrap_err();
        assert!(err.to_string().starts_with("chat template error: template does not compile"), "{err}");
    }

    #[test]
    fn strftime_subset() {
        // 2024-07-23 13:05:09 UTC, a Tuesday, day 205 of a leap year.
        let ts = 1_721_739_909;
        assert_eq!(strftime("%d %b %Y", ts).unwrap(), "23 Jul 2024");
        assert_eq!(strftime("%A %B %-d, %y %H:%M:%S %j %p %I", ts).unwrap(), "Tuesday July 23, 24 13:05:09 205 PM 01");
        assert_eq!(strftime("%F %T %%", 0).unwrap(), "1970-01-01 00:00:00 %");
        assert_eq!(strftime("%a", 0).unwrap(), "Thu");
        assert!(strftime("%Q", 0).is_err());
        for days in [-1_000_000i64, -1, 0, 59, 60, 11_016, 19_722, 2_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        let now = render_src("{{ strftime_now('%Y') }}", &[], false).unwrap();
        assert!(now.parse::<i32>().unwrap() >= 2024);
    }
}
