//! The coordinator's one error type. Every failure a client or an operator sees is an [`Error`]:
//! a [`Kind`] that says what sort of thing went wrong (and so whether retrying can help), and a
//! message that says what to do. Kinds become gRPC codes, and HTTP statuses with OpenAI error
//! objects, here and nowhere else.

use tonic::{Code, Status};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// the request is malformed, or past a size limit
    InvalidRequest,
    /// the request asks for more than the model's context or the KV cache can ever hold
    OutOfRange,
    /// the server is at capacity now (a full queue, a reader that fell behind): retry later
    Capacity,
    /// no such model
    NotFound,
    /// the model is already loaded
    AlreadyExists,
    /// the model cannot do what was asked (a chat without a chat template)
    Unsupported,
    /// the request's deadline passed
    Deadline,
    /// the server cannot serve now: starting, draining, recovering, or the model is being
    /// unloaded
    Unavailable,
    /// a rank could not be reached, hung, or its collective failed
    RankUnavailable,
    /// a bug: an invariant did not hold
    Internal,
    /// the request lacks the API token, or has a wrong one
    Unauthenticated,
}

impl Kind {
    fn code(self) -> Code {
        match self {
            Kind::InvalidRequest => Code::InvalidArgument,
            Kind::OutOfRange => Code::OutOfRange,
            Kind::Capacity => Code::ResourceExhausted,
            Kind::NotFound => Code::NotFound,
            Kind::AlreadyExists => Code::AlreadyExists,
            Kind::Unsupported => Code::FailedPrecondition,
            Kind::Deadline => Code::DeadlineExceeded,
            Kind::Unavailable | Kind::RankUnavailable => Code::Unavailable,
            Kind::Internal => Code::Internal,
            Kind::Unauthenticated => Code::Unauthenticated,
        }
    }

    /// The kind of a status this server produced (the inverse of [`Kind::code`]), e.g. an error
    /// that ended a response stream.
    pub fn of_status(code: Code) -> Kind {
        match code {
            Code::InvalidArgument => Kind::InvalidRequest,
            Code::OutOfRange => Kind::OutOfRange,
            Code::ResourceExhausted => Kind::Capacity,
            Code::NotFound => Kind::NotFound,
            Code::AlreadyExists => Kind::AlreadyExists,
            Code::FailedPrecondition => Kind::Unsupported,
            Code::DeadlineExceeded => Kind::Deadline,
            Code::Unavailable => Kind::Unavailable,
            Code::Unauthenticated | Code::PermissionDenied => Kind::Unauthenticated,
            _ => Kind::Internal,
        }
    }

    /// The HTTP status of the OpenAI-compatible API.
    pub fn http_status(self) -> u16 {
        match self {
            Kind::InvalidRequest | Kind::OutOfRange | Kind::Unsupported => 400,
            Kind::Unauthenticated => 401,
            Kind::NotFound => 404,
            Kind::AlreadyExists => 409,
            Kind::Capacity => 429,
            Kind::Internal => 500,
            Kind::Unavailable | Kind::RankUnavailable => 503,
            Kind::Deadline => 504,
        }
    }

    /// The `type` of an OpenAI error object.
    fn openai_type(self) -> &'static str {
        match self {
            Kind::InvalidRequest | Kind::OutOfRange | Kind::Unsupported | Kind::AlreadyExists => "invalid_request_error",
            Kind::Unauthenticated => "authentication_error",
            Kind::NotFound => "not_found_error",
            Kind::Capacity => "rate_limit_error",
            Kind::Unavailable | Kind::RankUnavailable | Kind::Deadline => "service_unavailable_error",
            Kind::Internal => "server_error",
        }
    }

    /// The kind of a status a rank answered with. A rank refuses what a request asked for
    /// (the request's kinds); anything else means the rank or its group is in trouble.
    pub fn of_rank_status(code: Code) -> Kind {
        match code {
            Code::InvalidArgument => Kind::InvalidRequest,
            Code::OutOfRange => Kind::OutOfRange,
            Code::NotFound => Kind::NotFound,
            Code::AlreadyExists => Kind::AlreadyExists,
            Code::ResourceExhausted => Kind::Capacity,
            _ => Kind::RankUnavailable,
        }
    }

    /// Whether a rank refusing with this kind concerns only the request it was refused for: the
    /// rank ran nothing, and the group is intact. (A rank short of KV cache is one: recovering
    /// the group would not give it more.)
    pub fn concerns_one_request(self) -> bool {
        matches!(self, Kind::InvalidRequest | Kind::OutOfRange | Kind::NotFound | Kind::AlreadyExists | Kind::Capacity)
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

    pub fn out_of_range(message: impl Into<String>) -> Self {
        Self::new(Kind::OutOfRange, message)
    }

    pub fn capacity(message: impl Into<String>) -> Self {
        Self::new(Kind::Capacity, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Kind::NotFound, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Kind::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Kind::Internal, message)
    }

    /// The error of a rank that answered `status`, its message prefixed with `context`.
    pub fn from_rank(context: &str, status: &Status) -> Self {
        Self::new(Kind::of_rank_status(status.code()), format!("{context}: {}", status.message()))
    }
}

impl Error {
    /// The error of a status this server produced.
    pub fn from_status(status: &Status) -> Self {
        Self::new(Kind::of_status(status.code()), status.message())
    }

    /// The OpenAI error object (`{"error": {...}}`); `param` names the request field at fault.
    pub fn openai_body(&self, param: Option<&str>) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind.openai_type(),
                "param": param,
                "code": self.kind.http_status(),
            }
        })
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

    #[test]
    fn kinds_map_to_codes_and_rank_codes_back() {
        let status = Status::from(Error::capacity("queue full"));
        assert_eq!((status.code(), status.message()), (Code::ResourceExhausted, "queue full"));
        for code in [Code::InvalidArgument, Code::OutOfRange, Code::NotFound, Code::AlreadyExists, Code::ResourceExhausted] {
            let kind = Kind::of_rank_status(code);
            assert!(kind.concerns_one_request(), "{code:?}");
            assert_eq!(kind.code(), code);
        }
        for code in [Code::Unavailable, Code::Internal, Code::DeadlineExceeded, Code::FailedPrecondition, Code::Unknown] {
            assert_eq!(Kind::of_rank_status(code), Kind::RankUnavailable, "{code:?}");
            assert!(!Kind::of_rank_status(code).concerns_one_request());
        }
        let error = Error::from_rank("rank 1", &Status::invalid_argument("bad seed"));
        assert_eq!(error, Error::invalid("rank 1: bad seed"));
    }

    #[test]
    fn kinds_map_to_http_statuses_and_survive_a_status() {
        let kinds = [
            (Kind::InvalidRequest, 400),
            (Kind::OutOfRange, 400),
            (Kind::Unsupported, 400),
            (Kind::Unauthenticated, 401),
            (Kind::NotFound, 404),
            (Kind::Capacity, 429),
            (Kind::Unavailable, 503),
            (Kind::Internal, 500),
        ];
        for (kind, http) in kinds {
            assert_eq!(kind.http_status(), http, "{kind:?}");
            assert_eq!(Kind::of_status(kind.code()), kind);
        }
        assert_eq!(Kind::of_status(Kind::RankUnavailable.code()).http_status(), 503);
        let body = Error::capacity("queue full").openai_body(Some("n"));
        assert_eq!(body["error"]["message"], "queue full");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["param"], "n");
        assert_eq!(body["error"]["code"], 429);
    }
}
