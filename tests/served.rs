//! The served system end to end: `tpserve serve` (real rank processes, real sockets, real gRPC)
//! driven by the `tpserve generate` CLI and by a gRPC client.

mod common;


use common::{Served, ids_arg, parse_json_stream};

/// For every Qwen3 fixture at TP 1, 2 and 4, the greedy ids streamed through
/// `tpserve serve` + `tpserve generate --json --ignore-eos --temperature 0` equal the reference.
#[test]
fn greedy_ids_through_serve_and_generate_equal_reference() {
    for name in ["qwen3_a", "qwen3_b", "qwen3_c_bf16"] {
        for tp in [1, 2, 4] {
            let server = Served::start(name, tp);
            for (i, prompt) in common::expected(name).iter().enumerate() {
                let ids = ids_arg(&prompt.ids);
                let (stdout, ok) = server.generate(&[
                    "--prompt-ids", &ids, "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", "16",
                ]);
                assert!(ok, "{name} TP {tp} prompt {i}: generate failed: {stdout}");
                let (got, last) = parse_json_stream(&stdout);
                assert_eq!(got, prompt.greedy_new_ids, "{name} TP {tp} prompt {i}");
                assert_eq!(last["finish_reason"], "length", "{last}");
                assert_eq!(last["usage"]["completion_tokens"], 16, "{last}");
                assert_eq!(last["usage"]["prompt_tokens"].as_u64(), Some(prompt.ids.len() as u64), "{last}");
            }
        }
    }
}

/// Same seed and temperature give the same text; sampling actually samples.
#[test]
fn seeded_sampling_is_reproducible() {
    let server = Served::start("qwen3_a", 2);
    let run = |seed: &str| {
        let (stdout, ok) = server.generate(&[
            "--prompt", "Once upon a time", "--json", "--ignore-eos", "--temperature", "0.8", "--seed", seed,
            "--max-tokens", "24",
        ]);
        assert!(ok, "{stdout}");
        parse_json_stream(&stdout).0
    };
    let first = run("42");
    assert_eq!(first.len(), 24);
    assert_eq!(first, run("42"));
    let others: Vec<Vec<u32>> = ["1", "2", "3"].iter().map(|s| run(s)).collect();
    assert!(others.iter().any(|o| o != &first), "different seeds should give different samples");
}

/// README's first command: `tpserve demo` serves the bundled model at TP 2, streams, exits 0.
#[test]
fn demo_runs_and_exits_zero() {
    let output = common::tpserve().arg("demo").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed: {stderr}");
    // The bundled model's greedy continuation of the demo prompt (reference prompt 0) starts "ide".
    assert!(stdout.contains("Once upon a time, there was a little robot\nide"), "{stdout}");
    assert!(stderr.contains("tokens/s"), "{stderr}");
}

/// `serve --device cuda` in a build without the cuda feature exits at once, saying why and what
/// to do, before any rank starts; `--device tpu` names the choices.
#[cfg(not(feature = "cuda"))]
#[test]
fn serve_refuses_cuda_in_a_cpu_build() {
    for (device, needle) in [("cuda", "needs a build with the cuda feature"), ("tpu", "expected cpu or cuda")] {
        let output = common::tpserve()
            .args(["serve", "--model"])
            .arg(common::fixture("qwen3_a"))
            .args(["--tp", "2", "--listen", "127.0.0.1:0", "--device", device])
            .output()
            .unwrap();
        assert!(!output.status.success(), "--device {device} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(needle), "--device {device}: {stderr}");
    }
}
