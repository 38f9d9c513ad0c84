//! Models named by a Hugging Face Hub id, `ORG/NAME[@REVISION]`, instead of a directory.
//!
//! Files are fetched with the `hf-hub` crate into the standard cache (`$HF_HOME/hub`, by default
//! `~/.cache/huggingface/hub`), so they are shared with transformers and vLLM and fetched once.
//! `HF_ENDPOINT` (another hub or a mirror), `HF_TOKEN` (else the token file of the cache) and
//! `HF_HUB_OFFLINE=1` (the cache only, no network) mean what they mean to `huggingface_hub`. Each
//! process fetches only what it reads: the coordinator config, tokenizer and template, each rank
//! config and the weights. A local directory of the same name wins, as in vLLM.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

/// A model on the hub: its repository and revision (a branch, tag or commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubModel {
    pub repo: String,
    pub revision: String,
}

/// What the coordinator reads; all but config.json and tokenizer.json may be absent.
const COORDINATOR_FILES: [(&str, bool); 6] = [
    ("config.json", true),
    ("tokenizer.json", true),
    ("tokenizer_config.json", false),
    ("generation_config.json", false),
    ("chat_template.jinja", false),
    ("chat_template.json", false),
];

const INDEX: &str = "model.safetensors.index.json";

impl HubModel {
    /// A hub id, if `spec` is one and no local file or directory has that name.
    pub fn parse(spec: &str) -> Option<Self> {
        if Path::new(spec).exists() {
            return None;
        }
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, revision)) => (repo, revision),
            None => (spec, "main"),
        };
        let name_ok = |part: &str| !part.is_empty() && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        let revision_ok = !revision.is_empty() && revision.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
        match repo.split_once('/') {
            Some((org, name)) if name_ok(org) && name_ok(name) && !org.starts_with('.') && revision_ok => {
                Some(Self { repo: repo.to_owned(), revision: revision.to_owned() })
            }
            _ => None,
        }
    }

    /// The name the model is served under: the repository id.
    pub fn model_id(&self) -> &str {
        &self.repo
    }

    /// Fetches what the coordinator reads; returns the snapshot directory holding them.
    pub fn fetch_coordinator_files(&self) -> Result<PathBuf> {
        let source = Source::new(self)?;
        let mut dir = None;
        for (file, required) in COORDINATOR_FILES {
            if let Some(path) = source.get(file, required)? {
                dir.get_or_insert_with(|| snapshot_dir(&path));
            }
        }
        dir.context("no file was fetched")
    }

    /// Fetches what a rank reads: config.json and every safetensors file (the shards of the
    /// index, when there is one). Returns the snapshot directory.
    pub fn fetch_rank_files(&self) -> Result<PathBuf> {
        let source = Source::new(self)?;
        let config = source.get("config.json", true)?.context("config.json")?;
        let shards = match source.get(INDEX, false)? {
            Some(index) => shard_names(&index)?,
            None => vec!["model.safetensors".to_owned()],
        };
        for shard in &shards {
            source.get(shard, true)?;
        }
        Ok(snapshot_dir(&config))
    }
}

impl std::fmt::Display for HubModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.repo, self.revision)
    }
}

/// The cache, and the hub unless offline.
struct Source<'a> {
    model: &'a HubModel,
    cache: Cache,
    online: Option<ApiRepo>,
}

impl<'a> Source<'a> {
    fn new(model: &'a HubModel) -> Result<Self> {
        let cache = Cache::from_env();
        let repo = Repo::with_revision(model.repo.clone(), RepoType::Model, model.revision.clone());
        let online = if offline() {
            None
        } else {
            let token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()).or_else(|| cache.token());
            let api = ApiBuilder::from_env().with_token(token).with_progress(false).with_retries(3).build()?;
            Some(api.repo(repo))
        };
        Ok(Self { model, cache, online })
    }

    /// The file's path in the cache, fetched if needed; `None` if the repository has no such
    /// file and it is not `required`.
    fn get(&self, file: &str, required: bool) -> Result<Option<PathBuf>> {
        let repo = Repo::with_revision(self.model.repo.clone(), RepoType::Model, self.model.revision.clone());
        if let Some(path) = self.cache.repo(repo).get(file) {
            return Ok(Some(path));
        }
        let Some(api) = &self.online else {
            if required {
                bail!(
                    "{file} of {} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set",
                    self.model,
                    self.cache.path().display()
                );
            }
            return Ok(None);
        };
        tracing::info!(model = %self.model, file, "fetching from the hub");
        loop {
            match api.get(file) {
                Ok(path) => return Ok(Some(path)),
                Err(err) if !required && is_not_found(&err) => return Ok(None),
                // Another process (another rank, sharing the cache) is downloading the same file;
                // hf-hub gave up after 5 s of waiting for its lock. Wait for it: the next attempt
                // finds the file in the cache or takes the lock.
                Err(ApiError::LockAcquisition(lock)) => {
                    tracing::info!(model = %self.model, file, lock = %lock.display(), "another process is fetching this file; waiting");
                }
                Err(err) => {
                    let url = api.url(file);
                    return Err(anyhow::Error::new(err)).with_context(|| format!("cannot fetch {file} of {} from {url}", self.model));
                }
            }
        }
    }
}

/// HF_HUB_OFFLINE as huggingface_hub reads it.
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

fn is_not_found(err: &ApiError) -> bool {
    matches!(err, ApiError::RequestError(inner) if matches!(**inner, ureq::Error::Status(404, _)))
}

/// Files of one revision sit side by side in `snapshots/<commit>/`.
fn snapshot_dir(file: &Path) -> PathBuf {
    file.parent().map_or_else(|| PathBuf::from("."), Path::to_owned)
}

/// The shard files an index names, each once, in order.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
    let map = json["weight_map"].as_object().with_context(|| format!("{} has no weight_map", index.display()))?;
    let mut names: Vec<String> = Vec::new();
    for name in map.values().filter_map(serde_json::Value::as_str) {
        // A shard is a file name beside the index, never a path elsewhere.
        if name.contains('/') || name.contains("..") {
            bail!("{} names a shard outside the model: {name}", index.display());
        }
        if !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_told_from_paths() {
        let model = |repo: &str, revision: &str| Some(HubModel { repo: repo.into(), revision: revision.into() });
        assert_eq!(HubModel::parse("Qwen/Qwen3-0.6B"), model("Qwen/Qwen3-0.6B", "main"));
        assert_eq!(HubModel::parse("Qwen/Qwen3-0.6B@v1.0"), model("Qwen/Qwen3-0.6B", "v1.0"));
        assert_eq!(HubModel::parse("org/name@refs/pr/1"), model("org/name", "refs/pr/1"));
        for not_hub in ["/abs/dir", "one", "a/b/c", "./a/b", "../a/b", "a/b@", "a b/c", "src/model"] {
            assert_eq!(HubModel::parse(not_hub), None, "{not_hub}");
        }
        assert_eq!(HubModel::parse("Qwen/Qwen3-0.6B@abc").unwrap().to_string(), "Qwen/Qwen3-0.6B@abc");
    }
}
