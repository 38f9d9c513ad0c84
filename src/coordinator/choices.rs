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
