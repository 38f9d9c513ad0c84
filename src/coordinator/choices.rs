//! The `n` choices of one gRPC request as one response stream: each choice is its own sequence
//! and stream; their messages interleave, tagged with the choice's index. With tools (tool
//! choice auto) each choice's last message also carries the calls parsed from its output.
//!
//! The merged stream owns the choices' streams, so a client that cancels drops them all, and
//! the step loop frees their sequences. An error in one choice ends the whole stream, as a
//! gRPC stream can end only once.

use futures::stream::{self, BoxStream, StreamExt};

use super::stream::{ClientStream, Item};
use super::tools::{self, StreamParser, ToolChoice};
use crate::proto::v1 as pb;

/// Merges the choices' streams; choice `i` is `streams[i]`.
pub fn merge(streams: Vec<ClientStream>, tool_choice: ToolChoice) -> BoxStream<'static, Item> {
    let tagged = streams.into_iter().enumerate().map(move |(index, stream)| {
        let stream = match tool_choice {
            ToolChoice::None => stream.boxed(),
            ToolChoice::Auto => with_tool_calls(stream),
        };
        stream
            .map(move |item| {
                item.map(|mut message| {
                    message.index = index as u32;
                    message
                })
            })
            .boxed()
    });
    stream::select_all(tagged).boxed()
}

/// Passes the messages on unchanged, watching their text; the last one gets the calls found in
/// the whole output, and the finish reason TOOL_CALLS when there are any.
fn with_tool_calls(stream: ClientStream) -> BoxStream<'static, Item> {
    stream
        .scan(StreamParser::default(), |parser, item| {
            let item = item.map(|mut message| {
                parser.push(&message.text);
                if message.finish_reason != pb::FinishReason::Unspecified as i32 {
                    let output = std::mem::take(parser).finish();
                    attach(&mut message, &output);
                }
                message
            });
            futures::future::ready(Some(item))
        })
        .boxed()
}

/// Puts a finished output's calls on its last message.
pub fn attach(message: &mut pb::GenerateResponse, output: &tools::Output) {
    if output.calls.is_empty() {
        return;
    }
    message.finish_reason = pb::FinishReason::ToolCalls as i32;
    message.tool_calls = output.calls.iter().map(to_proto).collect();
}

pub fn to_proto(call: &tools::Call) -> pb::ToolCall {
    pb::ToolCall {
        id: call.id.clone(),
        r#type: "function".into(),
        function: Some(pb::FunctionCall { name: call.name.clone(), arguments: call.arguments.clone() }),
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::coordinator::stream::channel;

    fn message(text: &str, finish: pb::FinishReason) -> pb::GenerateResponse {
        pb::GenerateResponse { text: text.to_owned(), finish_reason: finish as i32, ..Default::default() }
    }

    /// Two choices on one stream: each message tagged with its choice, the raw text passed on,
    /// and with tool choice auto the last message of the choice that called a tool carries the
    /// call and the finish reason TOOL_CALLS; the other keeps its own.
    #[tokio::test]
    async fn choices_are_tagged_and_calls_attached() {
        let (mut calls, calls_stream) = channel(8);
        let (mut plain, plain_stream) = channel(8);
        calls.push(message("<tool_call>\n{\"name\": \"f\", ", pb::FinishReason::Unspecified));
        calls.push(message("\"arguments\": {\"x\": 1}}\n</tool_call>", pb::FinishReason::Unspecified));
        calls.end(Ok(message("", pb::FinishReason::Eos)));
        plain.push(message("hello", pb::FinishReason::Unspecified));
        plain.end(Ok(message("", pb::FinishReason::Length)));
        let merged: Vec<pb::GenerateResponse> =
            merge(vec![calls_stream, plain_stream], ToolChoice::Auto).map(Result::unwrap).collect().await;
        let of = |index: u32| merged.iter().filter(move |m| m.index == index).collect::<Vec<_>>();
        let (first, second) = (of(0), of(1));
        assert_eq!((first.len(), second.len()), (3, 2));
        assert_eq!(first.iter().map(|m| m.text.as_str()).collect::<String>(), "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>");
        let last = first[2];
        assert_eq!(last.finish_reason, pb::FinishReason::ToolCalls as i32);
        let function = last.tool_calls[0].function.as_ref().unwrap();
        assert_eq!((function.name.as_str(), function.arguments.as_str()), ("f", r#"{"x": 1}"#));
        assert_eq!(second[1].finish_reason, pb::FinishReason::Length as i32);
        assert!(second[1].tool_calls.is_empty());
    }
}
