//! The `n` choices of one gRPC request as one response stream: each choice is its own sequence
//! and stream; their messages interleave, tagged with the choice's index. With tools, each
//! choice's stream is read for calls first (`tools::stream`), as the HTTP API reads it.
//!
//! The merged stream owns the choices' streams, so a client that cancels drops them all, and
//! the step loop frees their sequences. An error in one choice ends the whole stream, as a
//! gRPC stream can end only once.

use futures::stream::{self, BoxStream, StreamExt};

use super::stream::{ClientStream, Item};
use super::tools::{self, ToolChoice};

/// Merges the choices' streams; choice `i` is `streams[i]`.
pub fn merge(streams: Vec<ClientStream>, tool_choice: &ToolChoice) -> BoxStream<'static, Item> {
    let tagged = streams.into_iter().enumerate().map(|(index, stream)| {
        tools::stream::read(stream, tool_choice)
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

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::coordinator::stream::channel;
    use crate::proto::v1 as pb;

    fn message(text: &str, finish: pb::FinishReason) -> pb::GenerateResponse {
        pb::GenerateResponse { text: text.to_owned(), finish_reason: finish as i32, ..Default::default() }
    }

    /// Two choices on one stream: each message tagged with its choice, and with tool choice auto
    /// the choice that called a tool has its markup withheld, the call on the message that
    /// closed it and the finish reason TOOL_CALLS; the other keeps its text and its reason.
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
            merge(vec![calls_stream, plain_stream], &ToolChoice::Auto).map(Result::unwrap).collect().await;
        let of = |index: u32| merged.iter().filter(move |m| m.index == index).collect::<Vec<_>>();
        let (first, second) = (of(0), of(1));
        assert_eq!((first.len(), second.len()), (3, 2));
        assert_eq!(first.iter().map(|m| m.text.as_str()).collect::<String>(), "");
        assert_eq!(first[2].finish_reason, pb::FinishReason::ToolCalls as i32);
        let function = first[1].tool_calls[0].function.as_ref().unwrap();
        assert_eq!((function.name.as_str(), function.arguments.as_str()), ("f", r#"{"x": 1}"#));
        assert_eq!(second[0].text, "hello");
        assert_eq!(second[1].finish_reason, pb::FinishReason::Length as i32);
        assert!(second[1].tool_calls.is_empty());
    }
}
