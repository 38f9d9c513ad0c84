//! Stop sequences over streamed text.
//!
//! Generated text reaches the client as a stream of deltas, and a stop string may be split
//! across any number of them (even inside a multi-byte character's worth of tokens, which the
//! detokenizer already resolves into whole characters). Once a piece of text has been streamed it
//! cannot be taken back, so the matcher holds back exactly the tail that could still grow into a
//! stop string, and releases it as soon as it is known not to.
//!
//! The stop strings of a request become one Aho-Corasick automaton, walked byte by byte as the
//! text arrives: a push costs time proportional to the new text, whatever the number of stop
//! strings, and the state's depth is the length of the tail to hold back. A request with many
//! long stop strings therefore cannot slow the step loop down for everyone else.

use std::sync::Arc;

/// Bounds on a request's stop strings, checked before it is admitted.
#[derive(Debug, Clone, Copy)]
pub struct StopLimits {
    pub max_count: usize,
    pub max_bytes: usize,
}

/// Checks client-supplied stop strings before a request is admitted.
///
/// An empty stop string would match at every position and end generation before the first
/// character, which is never what a client means; rejecting it up front gives a clear error
/// instead of a silently empty completion.
pub fn validate(stops: &[String], limits: StopLimits) -> Result<(), String> {
    if stops.len() > limits.max_count {
        return Err(format!(
            "{} stop sequences given; at most {} are allowed (--max-stop-sequences)",
            stops.len(),
            limits.max_count
        ));
    }
    for (i, stop) in stops.iter().enumerate() {
        if stop.is_empty() {
            return Err(format!("stop sequence {i} is empty; stop sequences must contain at least one character"));
        }
        if stop.len() > limits.max_bytes {
            return Err(format!(
                "stop sequence {i} is {} bytes long; at most {} bytes are allowed (--max-stop-bytes)",
                stop.len(),
                limits.max_bytes
            ));
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

/// The stop strings of one request as an Aho-Corasick automaton over bytes.
#[derive(Debug)]
pub struct StopSet {
    /// node 0 is the root (the empty prefix)
    nodes: Vec<Node>,
}

#[derive(Debug, Default)]
struct Node {
    /// (byte, child) sorted by byte
    children: Vec<(u8, u32)>,
    /// the node of the longest proper suffix of this prefix that is also a prefix of a stop
    fail: u32,
    /// length of this prefix
    depth: u32,
    /// length of the longest stop string that ends here (this prefix or one of its suffixes), 0
    /// when none does
    matched: u32,
}

impl StopSet {
    /// Empty strings are ignored: [`validate`] rejects them before admission, and ignoring keeps
    /// the automaton total even if a caller skips validation.
    pub fn new(stops: &[String]) -> Self {
        let mut nodes = vec![Node::default()];
        for stop in stops.iter().filter(|s| !s.is_empty()) {
            let mut at = 0usize;
            for &byte in stop.as_bytes() {
                at = match nodes[at].children.binary_search_by_key(&byte, |&(b, _)| b) {
                    Ok(i) => nodes[at].children[i].1 as usize,
                    Err(i) => {
                        let child = nodes.len();
                        let depth = nodes[at].depth + 1;
                        nodes.push(Node { depth, ..Node::default() });
                        nodes[at].children.insert(i, (byte, child as u32));
                        child
                    }
                };
            }
            nodes[at].matched = nodes[at].depth;
        }
        let mut set = Self { nodes };
        set.link();
        set
    }

    /// Failure links in breadth-first order, so a node's failure target is always finished
    /// before the node itself.
    fn link(&mut self) {
        let mut queue = std::collections::VecDeque::from([0u32]);
        while let Some(parent) = queue.pop_front() {
            let children = self.nodes[parent as usize].children.clone();
            for (byte, child) in children {
                let fail = if parent == 0 { 0 } else { self.next(self.nodes[parent as usize].fail, byte) };
                let inherited = self.nodes[fail as usize].matched;
                let node = &mut self.nodes[child as usize];
                node.fail = fail;
                node.matched = node.matched.max(inherited);
                queue.push_back(child);
            }
        }
    }

    fn child(&self, node: u32, byte: u8) -> Option<u32> {
        let children = &self.nodes[node as usize].children;
        children.binary_search_by_key(&byte, |&(b, _)| b).ok().map(|i| children[i].1)
    }

    /// The state after reading `byte` in state `node`.
    fn next(&self, mut node: u32, byte: u8) -> u32 {
        loop {
            if let Some(child) = self.child(node, byte) {
                return child;
            }
            if node == 0 {
                return 0;
            }
            node = self.nodes[node as usize].fail;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }
}

/// Per-sequence matcher for stop strings.
///
/// A stop string ends generation as soon as it is complete; of several completing at the same
/// character, the longest wins (its text starts earliest). This does not depend on how the text
/// was split into deltas. The held-back buffer is always shorter than the longest stop string.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Arc<StopSet>,
    /// automaton state after all text pushed so far
    state: u32,
    /// Text received but not yet emitted because it could be the start of a stop string: the
    /// last `depth(state)` bytes of the text.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self::with_set(Arc::new(StopSet::new(&stops)))
    }

    pub fn with_set(stops: Arc<StopSet>) -> Self {
        Self { stops, state: 0, held: String::new(), stopped: false }
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
        let base = self.held.len();
        self.held.push_str(delta);
        for (i, byte) in delta.bytes().enumerate() {
            self.state = self.stops.next(self.state, byte);
            let matched = self.stops.nodes[self.state as usize].matched as usize;
            if matched > 0 {
                // The match lies inside `held`, which always covers the automaton's depth. A stop
                // string starts with a whole character, so `start` is a character boundary.
                let start = base + i + 1 - matched;
                let emit = self.held[..start].to_owned();
                self.held.clear();
                self.stopped = true;
                return StopOutcome { emit, stopped: true };
            }
        }
        // Hold the longest tail that is a prefix of a stop string (the state's depth); it starts
        // at a character boundary for the same reason.
        let keep = self.stops.nodes[self.state as usize].depth as usize;
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_owned();
        self.held.drain(..cut);
        StopOutcome { emit, stopped: false }
    }

    /// Releases whatever is still held when generation ends for another reason (EOS, length):
    /// a partial stop string at the very end is ordinary output.
    pub fn finish(&mut self) -> String {
        self.state = 0;
        std::mem::take(&mut self.held)
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

    const LIMITS: StopLimits = StopLimits { max_count: 4, max_bytes: 8 };

    #[test]
    fn validate_rejects_empty() {
        assert!(validate(&[], LIMITS).is_ok());
        assert!(validate(&["a".into(), "\n".into()], LIMITS).is_ok());
        let err = validate(&["a".into(), String::new()], LIMITS).unwrap_err();
        assert!(err.contains("stop sequence 1 is empty"), "{err}");
        // Empty entries are ignored by the matcher itself.
        let mut m = StopMatcher::new(vec![String::new()]);
        assert_eq!(m.push("abc"), StopOutcome { emit: "abc".into(), stopped: false });
    }

    #[test]
    fn validate_names_the_limits() {
        let many: Vec<String> = (0..5).map(|i| i.to_string()).collect();
        let err = validate(&many, LIMITS).unwrap_err();
        assert!(err.contains("5 stop sequences") && err.contains("at most 4") && err.contains("--max-stop-sequences"), "{err}");
        let err = validate(&["123456789".into()], LIMITS).unwrap_err();
        assert!(err.contains("9 bytes") && err.contains("at most 8") && err.contains("--max-stop-bytes"), "{err}");
    }

    #[test]
    fn the_first_stop_to_complete_wins_whatever_the_split() {
        // "bcd" completes before "abcde" does.
        let (out, stopped, _) = run(&["abcde", "bcd"], &["abcde"]);
        assert_eq!((out.as_str(), stopped), ("a", true));
        let (out, stopped, _) = run(&["abcde", "bcd"], &["ab", "c", "de"]);
        assert_eq!((out.as_str(), stopped), ("a", true));
        // Two complete at the same character: the longer one (starting earlier) wins.
        let (out, stopped, _) = run(&["cd", "bcd"], &["abcdef"]);
        assert_eq!((out.as_str(), stopped), ("a", true));
        // A stop inside another's failed attempt, through a failure link.
        let (out, stopped, _) = run(&["abx", "bc"], &["a", "b", "c"]);
        assert_eq!((out.as_str(), stopped), ("a", true));
    }

    /// Every split of every text gives what a plain search over the whole text gives.
    #[test]
    fn agrees_with_a_plain_search_on_every_split() {
        fn reference(stops: &[&str], text: &str) -> (String, bool) {
            // earliest end; at equal ends, the longest
            let mut best: Option<(usize, usize)> = None;
            for stop in stops {
                for (start, _) in text.match_indices(stop) {
                    let end = start + stop.len();
                    if best.is_none_or(|(e, s)| end < e || (end == e && start < s)) {
                        best = Some((end, start));
                    }
                }
            }
            match best {
                Some((_, start)) => (text[..start].to_owned(), true),
                None => (text.to_owned(), false),
            }
        }
        let stops = ["aab", "ab", "bab", "é!", "ba"];
        let texts = ["xxaabab", "abba", "aaab", "é!é", "bbbb", "aé!x", "zzzz"];
        for text in texts {
            let chars: Vec<(usize, char)> = text.char_indices().collect();
            let boundary = |k: usize| chars.get(k).map_or(text.len(), |&(i, _)| i);
            for first in 0..=chars.len() {
                for second in first..=chars.len() {
                    let (a, b) = (boundary(first), boundary(second));
                    let (out, stopped, rest) = run(&stops, &[&text[..a], &text[a..b], &text[b..]]);
                    let full = if stopped { out.clone() } else { format!("{out}{rest}") };
                    assert_eq!((full, stopped), reference(&stops, text), "text {text:?} split at {a} and {b}");
                }
            }
        }
    }

    #[test]
    fn many_long_stops_stream_correctly() {
        let stops: Vec<String> = (0..400).map(|i| format!("{i:03}{}", "x".repeat(97))).collect();
        let mut m = StopMatcher::new(stops);
        let mut emitted = String::new();
        for _ in 0..1000 {
            emitted.push_str(&m.push("hello 12").emit);
        }
        let outcome = m.push(&format!("3{}", "x".repeat(97)));
        assert!(outcome.stopped);
        emitted.push_str(&outcome.emit);
        assert_eq!(emitted, format!("{}hello ", "hello 12".repeat(999)));
    }
}
