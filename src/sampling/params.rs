//! The sampling settings of one request and their validation. The sampler tolerates any
//! values (it clamps or ignores invalid ones); `validate` is where a client learns its request
//! was wrong.

use serde::{Deserialize, Serialize};

/// Largest `top_logprobs` a request may ask for (the OpenAI API limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Temperatures below this are treated as greedy: dividing logits by a smaller number
/// overflows f32 for ordinary logit magnitudes, and the result would be argmax anyway.
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// OpenAI and vLLM bound presence/frequency penalties to this magnitude.
const MAX_ADDITIVE_PENALTY: f32 = 2.0;

/// Per-request sampling settings. The default is greedy decoding with every filter off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 (or below [`GREEDY_TEMPERATURE`]) means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables (as does a value >= vocab size).
    pub top_k: u32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability mass
    /// reaches `top_p`; 1.0 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's; 0 disables.
    pub min_p: f32,
    /// vLLM/HF repetition penalty over prompt and generated tokens; 1.0 disables.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token generated at least once.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it has been generated.
    pub frequency_penalty: f32,
    /// Used as given; the coordinator picks a random seed when a request names none, so that
    /// the seed it reports (or retries with) reproduces the output.
    pub seed: u64,
    /// How many most likely alternatives to report per token; 0 reports none.
    pub top_logprobs: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Whether sampling reduces to argmax. NaN counts as greedy so that an unvalidated NaN
    /// can never poison the arithmetic.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_TEMPERATURE
    }

    /// Whether sampling reads nothing of the logits but which is the largest: greedy, no
    /// penalties (they change other tokens' logits first), no top logprobs (the chosen token's
    /// logprob is asked for apart, `Sampler::with_logprob`).
    pub fn reads_only_the_maximum(&self) -> bool {
        self.is_greedy() && !self.has_repetition_penalty() && !self.has_count_penalties() && self.top_logprobs == 0
    }

    pub(super) fn has_repetition_penalty(&self) -> bool {
        self.repetition_penalty != 1.0 && self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()
    }

    pub(super) fn has_count_penalties(&self) -> bool {
        (self.presence_penalty != 0.0 && self.presence_penalty.is_finite())
            || (self.frequency_penalty != 0.0 && self.frequency_penalty.is_finite())
    }

    /// Checks a request before admission, with messages meant for the client. The sampler
    /// itself tolerates invalid values (it clamps or ignores them) so that nothing on the rank
    /// can fail on them; this is where the client learns its request was wrong.
    pub fn validate(&self, vocab_size: usize) -> Result<(), String> {
        if vocab_size == 0 {
            return Err("the model's vocabulary is empty".into());
        }
        let t = self.temperature;
        if t.is_nan() {
            return Err("temperature must be a number, got NaN".into());
        }
        if t < 0.0 {
            return Err(format!("temperature must be >= 0, got {t}"));
        }
        if t.is_infinite() {
            return Err("temperature must be finite".into());
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {p}"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(format!("min_p must be in [0, 1], got {m}"));
        }
        let r = self.repetition_penalty;
        if !(r > 0.0 && r.is_finite()) {
            return Err(format!("repetition_penalty must be a finite number > 0, got {r}"));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return Err(format!("{name} must be a finite number, got {v}"));
            }
            if v.abs() > MAX_ADDITIVE_PENALTY {
                return Err(format!("{name} must be in [-{MAX_ADDITIVE_PENALTY}, {MAX_ADDITIVE_PENALTY}], got {v}"));
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}", self.top_logprobs));
        }
        if self.top_logprobs as usize > vocab_size {
            return Err(format!("top_logprobs ({}) exceeds the vocabulary size ({vocab_size})", self.top_logprobs));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_each_bad_value() {
        let ok = SamplingParams::default();
        assert_eq!(ok.validate(100), Ok(()));
        assert_eq!(
            SamplingParams {
                temperature: 0.7,
                top_k: 50,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                seed: 1,
                top_logprobs: 20
            }
            .validate(100),
            Ok(())
        );
        let bad = [
            (SamplingParams { temperature: f32::NAN, ..ok }, "temperature"),
            (SamplingParams { temperature: -0.1, ..ok }, "temperature"),
            (SamplingParams { temperature: f32::INFINITY, ..ok }, "temperature"),
            (SamplingParams { top_p: 0.0, ..ok }, "top_p"),
            (SamplingParams { top_p: 1.01, ..ok }, "top_p"),
            (SamplingParams { top_p: f32::NAN, ..ok }, "top_p"),
            (SamplingParams { min_p: -0.1, ..ok }, "min_p"),
            (SamplingParams { min_p: 1.5, ..ok }, "min_p"),
            (SamplingParams { min_p: f32::NAN, ..ok }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..ok }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: -1.0, ..ok }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: f32::NAN, ..ok }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: f32::INFINITY, ..ok }, "repetition_penalty"),
            (SamplingParams { presence_penalty: f32::NAN, ..ok }, "presence_penalty"),
            (SamplingParams { presence_penalty: 2.5, ..ok }, "presence_penalty"),
            (SamplingParams { frequency_penalty: f32::NEG_INFINITY, ..ok }, "frequency_penalty"),
            (SamplingParams { frequency_penalty: -3.0, ..ok }, "frequency_penalty"),
            (SamplingParams { top_logprobs: 21, ..ok }, "top_logprobs"),
        ];
        for (p, field) in bad {
            let err = p.validate(100).unwrap_err();
            assert!(err.starts_with(field), "{p:?}: {err}");
        }
        assert!(SamplingParams { top_logprobs: 5, ..ok }.validate(3).unwrap_err().contains("vocabulary"));
        assert!(ok.validate(0).is_err());
    }
}
