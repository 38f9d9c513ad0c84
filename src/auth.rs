//! Shared-secret access control.
//!
//! - The **cluster token** lets only the coordinator drive a rank: every rank RPC carries it in
//!   `x-tpserve-cluster-token` (health and reflection stay open for probes).
//! - The **API token** (optional) protects the public Generator service, and the **admin
//!   token** the Admin service, which is refused outright when no admin token is configured:
//!   loading models from arbitrary paths is not something to leave open by default.
//!
//! Tokens come from a file (first line, trimmed) or an environment variable, never from the
//! command line, where `ps` would show them.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

pub const CLUSTER_TOKEN_HEADER: &str = "x-tpserve-cluster-token";
pub const CLUSTER_TOKEN_ENV: &str = "TPSERVE_CLUSTER_TOKEN";
pub const API_TOKEN_ENV: &str = "TPSERVE_API_TOKEN";
pub const ADMIN_TOKEN_ENV: &str = "TPSERVE_ADMIN_TOKEN";

/// A shared secret. Debug does not print it.
#[derive(Clone)]
pub struct Secret(Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    pub fn new(value: &str) -> Result<Self> {
        let value = value.trim();
        if value.is_empty() {
            bail!("a token must not be empty");
        }
        if !value.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("a token must be printable ASCII without spaces (it travels in gRPC metadata)");
        }
        Ok(Self(value.into()))
    }

    /// A fresh random token (for `tpserve serve`, which starts both sides itself).
    pub fn random() -> Self {
        let bytes: [u8; 24] = rand::random();
        Self(bytes.iter().map(|b| format!("{b:02x}")).collect::<String>().into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Compares in time independent of where the first difference is.
    fn matches(&self, presented: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        if expected.len() != presented.len() {
            return false;
        }
        expected.iter().zip(presented).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
    }
}

/// Reads a token from `file` if given, else from the environment variable `env`.
pub fn load_token(file: Option<&Path>, env: &str) -> Result<Option<Secret>> {
    if let Some(file) = file {
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read token file {}", file.display()))?;
        let first = text.lines().next().unwrap_or_default();
        return Secret::new(first).map(Some).with_context(|| format!("token file {}", file.display()));
    }
    match std::env::var(env) {
        Ok(value) => Secret::new(&value).map(Some).with_context(|| format!("environment variable {env}")),
        Err(_) => Ok(None),
    }
}

/// Server side: refuses requests without the expected token.
#[derive(Clone)]
pub struct RequireToken {
    token: Option<Secret>,
    /// with no token configured: refuse everything (Admin) or accept everything (optional auth)
    required: bool,
    header: &'static str,
    what: &'static str,
}

impl RequireToken {
    /// The rank's check of the cluster token (open when none is configured).
    pub fn cluster(token: Option<Secret>) -> Self {
        Self { token, required: false, header: CLUSTER_TOKEN_HEADER, what: "cluster token" }
    }

    /// The public API's optional bearer token.
    pub fn api(token: Option<Secret>) -> Self {
        Self { token, required: false, header: "authorization", what: "API token" }
    }

    /// The Admin service's bearer token, which must be configured for Admin to work at all.
    pub fn admin(token: Option<Secret>) -> Self {
        Self { token, required: true, header: "authorization", what: "admin token" }
    }
}

impl Interceptor for RequireToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            if self.required {
                return Err(Status::permission_denied(format!(
                    "this service is disabled: start the server with an {} ({ADMIN_TOKEN_ENV} or --admin-token-file)",
                    self.what
                )));
            }
            return Ok(request);
        };
        let presented = request.metadata().get(self.header).map(|v| v.as_bytes());
        let presented = match (self.header, presented) {
            ("authorization", Some(value)) => value.strip_prefix(b"Bearer ").unwrap_or(b""),
            (_, Some(value)) => value,
            (_, None) => {
                return Err(Status::unauthenticated(format!("missing {}: send it in the {} header", self.what, self.header)));
            }
        };
        if token.matches(presented) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(format!("wrong {}", self.what)))
        }
    }
}

/// Client side: adds a token to every request.
#[derive(Clone)]
pub struct AttachToken {
    value: Option<MetadataValue<tonic::metadata::Ascii>>,
    header: &'static str,
}

impl AttachToken {
    pub fn cluster(token: Option<&Secret>) -> Result<Self> {
        let value = token.map(|t| t.expose().parse()).transpose().context("cluster token is not valid metadata")?;
        Ok(Self { value, header: CLUSTER_TOKEN_HEADER })
    }

    pub fn bearer(token: Option<&Secret>) -> Result<Self> {
        let value = token
            .map(|t| format!("Bearer {}", t.expose()).parse())
            .transpose()
            .context("token is not valid metadata")?;
        Ok(Self { value, header: "authorization" })
    }
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.value {
            request.metadata_mut().insert(self.header, value.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(mut interceptor: RequireToken, header: Option<(&'static str, &str)>) -> Result<(), tonic::Code> {
        let mut request = Request::new(());
        if let Some((name, value)) = header {
            request.metadata_mut().insert(name, value.parse().unwrap());
        }
        interceptor.call(request).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn tokens_are_checked() {
        let token = Secret::new("s3cret").unwrap();
        let cluster = RequireToken::cluster(Some(token.clone()));
        assert_eq!(check(cluster.clone(), Some((CLUSTER_TOKEN_HEADER, "s3cret"))), Ok(()));
        assert_eq!(check(cluster.clone(), Some((CLUSTER_TOKEN_HEADER, "s3creT"))), Err(tonic::Code::Unauthenticated));
        assert_eq!(check(cluster, None), Err(tonic::Code::Unauthenticated));
        let api = RequireToken::api(Some(token));
        assert_eq!(check(api.clone(), Some(("authorization", "Bearer s3cret"))), Ok(()));
        assert_eq!(check(api, Some(("authorization", "s3cret"))), Err(tonic::Code::Unauthenticated));
        assert_eq!(check(RequireToken::api(None), None), Ok(()));
        assert_eq!(check(RequireToken::admin(None), Some(("authorization", "Bearer x"))), Err(tonic::Code::PermissionDenied));
        assert!(Secret::new("  ").is_err());
        assert!(Secret::new("has space").is_err());
    }
}
