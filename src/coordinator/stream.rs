//! The response stream between a model's step loop and one client.
//!
//! One step loop serves every stream of a model, so it must never wait on a client: a client
//! that stops reading (an HTTP/2 window that stays shut) would otherwise freeze every other
//! stream of the model. Each stream has a bounded buffer; a message that does not fit is not
//! waited for: the stream is cut off, its sequence freed, and the client learns why after the
//! messages already buffered. The last item of a stream (the finish message, or an error) goes
//! into a slot beside the buffer, so ending a stream never waits either.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::Status;

use super::error::Error;
use crate::proto::v1 as pb;

pub type Item = Result<pb::GenerateResponse, Status>;

/// The step loop's end of a stream.
pub struct ClientSender {
    /// None once the stream has been ended
    buffer: Option<mpsc::Sender<Item>>,
    last: Arc<Mutex<Option<Item>>>,
    capacity: usize,
}

/// What [`ClientSender::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Push {
    Sent,
    /// the client has gone away (or the stream was already ended)
    Gone,
    /// the client is `capacity` messages behind: the stream must be cut off
    Behind,
}

/// The client's end: the buffered messages, then the last item, then the end of the stream.
pub struct ClientStream {
    buffer: mpsc::Receiver<Item>,
    last: Arc<Mutex<Option<Item>>>,
}

/// A stream that buffers at most `capacity` messages for its client.
pub fn channel(capacity: usize) -> (ClientSender, ClientStream) {
    let (sender, receiver) = mpsc::channel(capacity.max(1));
    let last = Arc::new(Mutex::new(None));
    (
        ClientSender { buffer: Some(sender), last: last.clone(), capacity: capacity.max(1) },
        ClientStream { buffer: receiver, last },
    )
}

impl ClientSender {
    /// Queues a message without waiting.
    pub fn push(&self, message: pb::GenerateResponse) -> Push {
        let Some(buffer) = &self.buffer else { return Push::Gone };
        match buffer.try_send(Ok(message)) {
            Ok(()) => Push::Sent,
            Err(mpsc::error::TrySendError::Full(_)) => Push::Behind,
            Err(mpsc::error::TrySendError::Closed(_)) => Push::Gone,
        }
    }

    /// Whether the client has gone away (or the stream was ended).
    pub fn is_closed(&self) -> bool {
        self.buffer.as_ref().is_none_or(mpsc::Sender::is_closed)
    }

    /// How many messages the client may fall behind before the stream is cut off.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Ends the stream: the client reads `last` after the messages already buffered. Later
    /// calls do nothing, so the first ending wins.
    pub fn end(&mut self, last: Item) {
        if self.buffer.is_none() {
            return;
        }
        // The slot is filled before the buffer's sender is dropped, so the client, which reads
        // the slot only once the buffer reports its end, always finds it.
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(last);
        self.buffer = None;
    }

    /// Ends the stream with an error.
    pub fn fail(&mut self, error: Error) {
        self.end(Err(error.into()));
    }
}

impl Stream for ClientStream {
    type Item = Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        match self.buffer.poll_recv(cx) {
            Poll::Ready(Some(item)) => Poll::Ready(Some(item)),
            Poll::Ready(None) => Poll::Ready(self.last.lock().unwrap_or_else(|p| p.into_inner()).take()),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    fn message(text: &str) -> pb::GenerateResponse {
        pb::GenerateResponse { text: text.to_owned(), ..Default::default() }
    }

    #[tokio::test]
    async fn a_full_buffer_is_reported_not_waited_for() {
        let (mut sender, mut stream) = channel(2);
        assert_eq!(sender.push(message("a")), Push::Sent);
        assert_eq!(sender.push(message("b")), Push::Sent);
        assert_eq!(sender.push(message("c")), Push::Behind);
        sender.fail(Error::capacity("behind"));
        assert_eq!(sender.push(message("d")), Push::Gone);
        let texts: Vec<Item> = (&mut stream).collect().await;
        assert_eq!(texts.len(), 3);
        assert_eq!(texts[0].as_ref().unwrap().text, "a");
        assert_eq!(texts[1].as_ref().unwrap().text, "b");
        assert_eq!(texts[2].as_ref().unwrap_err().code(), tonic::Code::ResourceExhausted);
    }

    #[tokio::test]
    async fn the_last_item_follows_the_buffer_even_when_it_is_full() {
        let (mut sender, stream) = channel(1);
        assert_eq!(sender.push(message("a")), Push::Sent);
        sender.end(Ok(message("done")));
        // A second ending does not replace the first.
        sender.fail(Error::internal("late"));
        let items: Vec<Item> = stream.collect().await;
        let texts: Vec<String> = items.into_iter().map(|i| i.unwrap().text).collect();
        assert_eq!(texts, ["a", "done"]);
    }

    #[tokio::test]
    async fn a_dropped_client_closes_the_sender() {
        let (sender, stream) = channel(4);
        assert!(!sender.is_closed());
        drop(stream);
        assert!(sender.is_closed());
        assert_eq!(sender.push(message("a")), Push::Gone);
    }
}
