//! Stop sequences over streamed text.
//!
//! Generated text reaches the client as a stream of deltas, and a stop string may be split
//! across any number of them (even inside a multi-byte character's worth of tokens, which the
//! detokenizer already resolves into whole characters). Once a piece of text has been streamed it
//! cannot be taken back, so the matcher holds back exactly the tail that could still grow into a
//! stop string, and releases it as soon as it is known not to.

/// Checks client-supplied stop strings before a request is admitted.
///
/// An empty stop string would match at every position and end generation before the first
/// character, which is never what a client means; rejecting it up front gives a clear error
/// instead of a silently empty completion.
pub fn validate(stops: &[String]) -> Result<(), String> {
    for (i, stop) in stops.iter().enumerate() {
        if stop.is_empty() {
            return Err(format!("stop sequence {i} is empty; stop sequences must contain at least one character"));
        }
    }
    Ok(())
}

/// What a single [`StopMatcher::push`] produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutcome {
    /// Text that is safe to send to the client now (never contains a stop string or any part
    /// of one that matched).
    pub emit: String,
    /// A stop string completed: generation for this sequence should end, and everything after
    /// `emit` is discarded.
    pub stopped: bool,
}

/// Per-sequence matcher for stop strings.
///
/// The held-back buffer never grows beyond the longest stop string (minus one byte) plus the
/// current delta, so each push costs O((held + delta) * number of stops) regardless of how
/// long the generation has been running.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted because its tail could be the start of a stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are dropped here (rather than failing) because construction happens
    /// after admission, where [`validate`] has already rejected them; dropping keeps the matcher
    /// total even if a caller skips validation.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self { stops, held: String::new(), stopped: false }
    }

    /// Whether a stop string has already matched; later pushes then emit nothing.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next piece of decoded text.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome { emit: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            // Nothing can ever be held back; skip the buffer entirely.
            return StopOutcome { emit: delta.to_owned(), stopped: false };
        }
        self.held.push_str(delta);

        // The earliest complete match wins: text before it is what the client would have seen
        // had the stop string arrived in one delta.
        let earliest = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(pos) = earliest {
            let emit = self.held[..pos].to_owned();
            self.held.clear();
            self.stopped = true;
            return StopOutcome { emit, stopped: true };
        }

        let keep_from = self.hold_start();
        let emit = self.held[..keep_from].to_owned();
        self.held.drain(..keep_from);
        StopOutcome { emit, stopped: false }
    }

    /// Releases whatever is still held when generation ends for another reason (EOS, length):
    /// a partial stop string at the very end is ordinary output.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Byte offset in `held` from which the tail is a proper prefix of some stop string; the
    /// buffer length when no tail qualifies.
    ///
    /// Only char boundaries are candidates, so the later slicing can never split a character.
    /// Scanning from the front returns the longest such tail, which is required: a shorter
    /// tail could also match, but releasing the longer one could release the start of a stop.
    fn hold_start(&self) -> usize {
        let bytes = self.held.as_bytes();
        let max_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A full match was ruled out by the caller, so only tails shorter than the longest
        // stop string can still become one.
        let lower = bytes.len().saturating_sub(max_stop.saturating_sub(1));
        for (start, _) in self.held.char_indices() {
            if start < lower {
                continue;
            }
            let tail = &bytes[start..];
            if self.stops.iter().any(|s| s.as_bytes().starts_with(tail)) {
                return start;
            }
        }
        bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            let o = m.push(d);
            out.push_str(&o.emit);
            if o.stopped {
                return (out, true, m.finish());
            }
        }
        let rest = m.finish();
        (out, false, rest)
    }

    #[test]
    fn no_stops_passes_through() {
        let (out, stopped, rest) = run(&[], &["hello ", "world"]);
        assert_eq!(out, "hello world");
        assert!(!stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn stop_in_single_delta() {
        let (out, stopped, _) = run(&["END"], &["abc END def"]);
        assert_eq!(out, "abc ");
        assert!(stopped);
    }

    #[test]
    fn stop_spanning_several_deltas() {
        let mut m = StopMatcher::new(vec!["<stop>".into()]);
        assert_eq!(m.push("foo <"), StopOutcome { emit: "foo ".into(), stopped: false });
        assert_eq!(m.push("st"), StopOutcome { emit: "".into(), stopped: false });
        assert_eq!(m.push("o"), StopOutcome { emit: "".into(), stopped: false });
        assert_eq!(m.push("p> bar"), StopOutcome { emit: "".into(), stopped: true });
        assert!(m.is_stopped());
        // After stopping nothing more comes out.
        assert_eq!(m.push("more"), StopOutcome { emit: "".into(), stopped: true });
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn partial_match_released_when_it_diverges() {
        let mut m = StopMatcher::new(vec!["<stop>".into()]);
        assert_eq!(m.push("a <st").emit, "a ");
        let o = m.push("art");
        assert!(!o.stopped);
        assert_eq!(o.emit, "<start");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn partial_match_at_end_flushed_by_finish() {
        let (out, stopped, rest) = run(&["###"], &["x #", "#"]);
        assert_eq!(out, "x ");
        assert!(!stopped);
        assert_eq!(rest, "##");
    }

    #[test]
    fn overlapping_prefix_keeps_later_candidate() {
        // "aab" must be found even though the first 'a' starts a failed attempt.
        let (out, stopped, _) = run(&["aab"], &["xa", "a", "b"]);
        assert_eq!(out, "x");
        assert!(stopped);
        // "aba" is held as a possible start, then fails, while a later start succeeds.
        let (out, stopped, _) = run(&["abab"], &["aba", "ab", "ab"]);
        assert_eq!(out, "aba");
        assert!(stopped);
    }

    #[test]
    fn multiple_stops_earliest_wins() {
        let (out, stopped, _) = run(&["world", "lo w"], &["hel", "lo world"]);
        assert_eq!(out, "hel");
        assert!(stopped);
        let (out, stopped, _) = run(&["\n\n", "User:"], &["Answer: 4\n", "User: next"]);
        assert_eq!(out, "Answer: 4\n");
        assert!(stopped);
    }

    #[test]
    fn longest_held_tail_among_stops() {
        let mut m = StopMatcher::new(vec!["abc".into(), "bcd".into()]);
        // "ab" could start "abc"; "b" could start "bcd": hold from the earliest.
        assert_eq!(m.push("xab").emit, "x");
        let o = m.push("cz");
        assert_eq!(o, StopOutcome { emit: String::new(), stopped: true });
    }

    #[test]
    fn multibyte_characters_never_split() {
        // Stop string made of multi-byte characters, arriving one character at a time.
        let (out, stopped, _) = run(&["終了"], &["日本", "語終", "了です"]);
        assert_eq!(out, "日本語");
        assert!(stopped);
        // A stop sharing a leading byte pattern with the text must not cause a split slice.
        let (out, stopped, rest) = run(&["é!"], &["café", "é", "?😀"]);
        assert_eq!(out, "caféé?😀");
        assert!(!stopped);
        assert_eq!(rest, "");
        let (out, stopped, _) = run(&["😀😁"], &["a😀", "😁b"]);
        assert_eq!(out, "a");
        assert!(stopped);
        // Partial emoji-sequence stop that diverges.
        let (out, stopped, rest) = run(&["😀😁"], &["a😀", "😂"]);
        assert_eq!(out, "a😀😂");
        assert!(!stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn empty_deltas_are_harmless() {
        let (out, stopped, rest) = run(&["zz"], &["", "a", "", "z", ""]);
        assert_eq!(out, "a");
        assert!(!stopped);
        assert_eq!(rest, "z");
    }

    #[test]
    fn validate_rejects_empty() {
        assert!(validate(&[]).is_ok());
        assert!(validate(&["a".into(), "\n".into()]).is_ok());
        let err = validate(&["a".into(), String::new()]).unwrap_err();
        assert!(err.contains("stop sequence 1 is empty"), "{err}");
        // Empty entries are ignored by the matcher itself.
        let mut m = StopMatcher::new(vec![String::new()]);
        assert_eq!(m.push("abc"), StopOutcome { emit: "abc".into(), stopped: false });
    }
}
