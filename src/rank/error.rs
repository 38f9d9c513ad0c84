//! The rank's one error type. A [`Kind`] says what went wrong in terms the coordinator acts on:
//! a refusal of one request (it ran nothing, the group is intact), a rank not ready for the call,
//! a failed collective, or a bug. Kinds become gRPC codes here and nowhere else; the coordinator
//! maps the codes back (`coordinator::error::Kind::of_rank_status`).

use tonic::{Code, Status};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// the request is malformed (bad ids, positions, sampling parameters, model files)
    InvalidRequest,
    /// a sequence would reach past the model's context
    OutOfRange,
    /// the step would take more KV cache than this rank has
    Capacity,
    /// no such model on this rank
    NotFound,
    /// the rank is not in the state the call needs (no communicator yet, another epoch, a
    /// protocol version mismatch)
    NotReady,
    /// a newer Init superseded this one
    Superseded,
    /// the communicator could not be built, or a collective failed: the group must recover
    Collective,
    /// a bug, or a forward pass that failed: the group must recover
    Internal,
}

impl Kind {
    fn code(self) -> Code {
        match self {
            Kind::InvalidRequest => Code::InvalidArgument,
            Kind::OutOfRange => Code::OutOfRange,
            Kind::Capacity => Code::ResourceExhausted,
            Kind::NotFound => Code::NotFound,
            Kind::NotReady => Code::FailedPrecondition,
            Kind::Superseded => Code::Aborted,
            Kind::Collective => Code::Unavailable,
            Kind::Internal => Code::Internal,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: Kind,
    pub message: String,
}

impl Error {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Kind::InvalidRequest, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Kind::NotFound, message)
    }

    pub fn not_ready(message: impl Into<String>) -> Self {
        Self::new(Kind::NotReady, message)
    }

    pub fn collective(message: impl Into<String>) -> Self {
        Self::new(Kind::Collective, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Kind::Internal, message)
    }

    /// The model is not loaded here.
    pub fn model_not_loaded(model_id: &str) -> Self {
        Self::not_found(format!("model \"{model_id}\" is not loaded on this rank"))
    }

    /// The device worker is gone or dropped the call: only a restart helps (and a panic in the
    /// worker ends the process, so this is brief).
    pub fn worker_gone() -> Self {
        Self::internal("the device worker has stopped")
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<Error> for Status {
    fn from(error: Error) -> Status {
        Status::new(error.kind.code(), error.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The coordinator reads a refusal of one request from exactly these codes; everything else
    /// recovers the group.
    #[test]
    fn refusals_and_group_failures_keep_their_codes() {
        let code = |kind| Status::from(Error::new(kind, "x")).code();
        assert_eq!(code(Kind::InvalidRequest), Code::InvalidArgument);
        assert_eq!(code(Kind::OutOfRange), Code::OutOfRange);
        assert_eq!(code(Kind::Capacity), Code::ResourceExhausted);
        assert_eq!(code(Kind::NotFound), Code::NotFound);
        assert_eq!(code(Kind::Collective), Code::Unavailable);
        assert_eq!(code(Kind::Internal), Code::Internal);
        assert_eq!(Status::from(Error::model_not_loaded("m")).message(), "model \"m\" is not loaded on this rank");
    }
}
