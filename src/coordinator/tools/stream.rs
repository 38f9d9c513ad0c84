//! A choice's response stream as both public APIs return it when the output is read for calls:
//! each message's text is the content it adds, call markup withheld, and its `tool_calls` are the
//! calls whose blocks closed with it; the last message also gets what the end of the output
//! releases, and the finish reason TOOL_CALLS when there were calls. gRPC's Chat sends these
//! messages as they are; the HTTP API turns them into OpenAI deltas or a whole message.
//!
//! Every message still goes out, with its token and logprobs, when its text is withheld.

use futures::stream::{BoxStream, StreamExt};

use super::{Call, StreamParser, ToolChoice};
use crate::coordinator::stream::{ClientStream, Item};
use crate::proto::v1 as pb;

/// `stream` read as `choice` asks: unchanged when the output is not read for calls.
pub fn read(stream: ClientStream, choice: &ToolChoice) -> BoxStream<'static, Item> {
    if !choice.reads_calls() {
        return stream.boxed();
    }
    let parser = match choice.forced_prefix() {
        Some(prefix) => StreamParser::with_prefix(&prefix),
        None => StreamParser::default(),
    };
    stream
        .scan(parser, |parser, item| {
            let item = item.map(|mut message| {
                let mut out = parser.push(&message.text);
                if message.finish_reason != pb::FinishReason::Unspecified as i32 {
                    out.append(parser.finish());
                    if parser.calls() > 0 {
                        message.finish_reason = pb::FinishReason::ToolCalls as i32;
                    }
                }
                message.text = out.content;
                message.tool_calls = out.calls.iter().map(to_proto).collect();
                message
            });
            futures::future::ready(Some(item))
        })
        .boxed()
}

fn to_proto(call: &Call) -> pb::ToolCall {
    pb::ToolCall {
        id: call.id.clone(),
        r#type: "function".into(),
        function: Some(pb::FunctionCall { name: call.name.clone(), arguments: call.arguments.clone() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::stream::channel;

    fn message(text: &str, finish: pb::FinishReason) -> pb::GenerateResponse {
        pb::GenerateResponse { text: text.to_owned(), finish_reason: finish as i32, ..Default::default() }
    }

    fn call_of(message: &pb::GenerateResponse) -> (&str, &str) {
        let function = message.tool_calls[0].function.as_ref().unwrap();
        (function.name.as_str(), function.arguments.as_str())
    }

    async fn read_all(messages: Vec<pb::GenerateResponse>, choice: ToolChoice) -> Vec<pb::GenerateResponse> {
        let (mut sender, stream) = channel(16);
        let (last, rest) = messages.split_last().unwrap();
        for m in rest {
            sender.push(m.clone());
        }
        sender.end(Ok(last.clone()));
        read(stream, &choice).map(Result::unwrap).collect().await
    }

    /// Markup never reaches the text; each call rides on the message that closes its block, a
    /// call cut off by the end on the last message, whose finish reason becomes TOOL_CALLS.
    #[tokio::test]
    async fn calls_ride_on_the_message_that_closes_them() {
        use pb::FinishReason::{Eos, Unspecified};
        let out = read_all(
            vec![
                message("Checking.", Unspecified),
                message("<tool_call>\n{\"name\": \"f\", ", Unspecified),
                message("\"arguments\": {\"x\": 1}}\n</tool_call>", Unspecified),
                message("\n<tool_call>{\"name\": \"g\", \"arguments\": {}}", Unspecified),
                message("", Eos),
            ],
            ToolChoice::Auto,
        )
        .await;
        let texts: Vec<&str> = out.iter().map(|m| m.text.as_str()).collect();
        assert_eq!(texts, ["Checking.", "", "", "", ""]);
        let calls: Vec<usize> = out.iter().map(|m| m.tool_calls.len()).collect();
        assert_eq!(calls, [0, 0, 1, 0, 1]);
        assert_eq!(call_of(&out[2]), ("f", r#"{"x": 1}"#));
        assert_eq!(call_of(&out[4]), ("g", "{}"));
        assert_eq!(out[4].finish_reason, pb::FinishReason::ToolCalls as i32);
        // Not read for calls: the messages as they came.
        let plain = read_all(vec![message("<tool_call>", Unspecified), message("", Eos)], ToolChoice::None).await;
        assert_eq!((plain[0].text.as_str(), plain[1].finish_reason), ("<tool_call>", Eos as i32));
    }

    /// A forced opening is read in front of the output; output that does not make a call comes
    /// back as content, opening included, with the engine's finish reason.
    #[tokio::test]
    async fn a_forced_opening_is_read_in_front_of_the_output() {
        use pb::FinishReason::{Eos, Length};
        let named = ToolChoice::Function("f".into());
        let out = read_all(vec![message(" {\"x\": 2}}\n</tool_call>", Eos)], named.clone()).await;
        assert_eq!((out[0].text.as_str(), call_of(&out[0])), ("", ("f", r#"{"x": 2}"#)));
        let out = read_all(vec![message(" {\"x\": ", Length)], named).await;
        assert_eq!(out[0].text, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": ");
        assert_eq!((out[0].tool_calls.len(), out[0].finish_reason), (0, Length as i32));
    }
}
