//! Randomised robustness tests: the public API, a rank's step RPC, and the config.json and
//! safetensors parsers get random, huge and invalid input. Nothing may panic, every refusal must
//! be a deliberate status, and the servers must keep serving correctly afterwards.
//! docs/reliability.md records what is covered. The generator is seeded: failures reproduce.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tonic::Code;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn float(&mut self) -> f32 {
        match self.below(8) {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => -f32::INFINITY,
            3 => -(self.below(1000) as f32) / 100.0,
            4 => self.below(1_000_000) as f32,
            5 => 0.0,
            _ => self.below(2000) as f32 / 1000.0,
        }
    }
    fn text(&mut self) -> String {
        let len = match self.below(10) {
            0 => 0,
            1 => 20_000 + self.below(80_000) as usize,
            _ => self.below(64) as usize,
        };
        (0..len)
            .map(|_| match self.below(6) {
                0 => char::from_u32(0x4E00 + self.below(0x5000) as u32).unwrap_or('x'),
                1 => char::from_u32(0x1F600 + self.below(80) as u32).unwrap_or('x'),
                2 => ['\0', '\n', '\u{FFFD}', '\u{202E}'][self.below(4) as usize],
                _ => (b' ' + self.below(95) as u8) as char,
            })
            .collect()
    }
    fn ids(&mut self) -> Vec<u32> {
        let len = match self.below(10) {
            0 => 0,
            1 => 4000 + self.below(2000) as usize,
            _ => 1 + self.below(40) as usize,
        };
        (0..len)
            .map(|_| if self.chance(3) { self.next() as u32 } else { self.below(448) as u32 })
            .collect()
    }
}

fn random_params(rng: &mut Rng) -> pb::GenerationParams {
    let maybe = |rng: &mut Rng| rng.chance(50);
    pb::GenerationParams {
        max_tokens: maybe(rng).then(|| if rng.chance(10) { rng.next() as u32 } else { rng.below(40) as u32 }),
        temperature: maybe(rng).then(|| rng.float()),
        top_p: maybe(rng).then(|| rng.float()),
        top_k: maybe(rng).then(|| rng.next() as u32 % 1000),
        min_p: maybe(rng).then(|| rng.float()),
        repetition_penalty: maybe(rng).then(|| rng.float()),
        presence_penalty: maybe(rng).then(|| rng.float()),
        frequency_penalty: maybe(rng).then(|| rng.float()),
        seed: maybe(rng).then(|| rng.next()),
        stop: (0..rng.below(3)).map(|_| rng.text()).collect(),
        ignore_eos: rng.chance(50),
        logprobs: rng.chance(30),
        top_logprobs: if rng.chance(20) { rng.next() as u32 % 50 } else { 0 },
    }
}

/// A refusal is fine when it is one a client can act on; INTERNAL or UNKNOWN would be a bug.
fn acceptable(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument | Code::NotFound | Code::OutOfRange | Code::ResourceExhausted | Code::FailedPrecondition
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn public_api_survives_random_requests() {
    const CASES: usize = 600;
    let server = common::Served::start_with("qwen3_a", 2, &["--max-waiting", "64"]);
    let address: Address = server.address.parse().unwrap();
    let mut client = GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap());
    let mut rng = Rng(0x5EED_0F_7E57);
    let (mut accepted, mut refused, mut transport_errors) = (0, 0, 0);
    let mut codes = std::collections::BTreeMap::<String, usize>::new();
    for case in 0..CASES {
        let model = if rng.chance(10) { rng.text() } else { String::new() };
        let result = match rng.below(10) {
            0..=4 => {
                let request = pb::GenerateRequest {
                    model,
                    prompt: if rng.chance(50) { rng.text() } else { String::new() },
                    prompt_ids: if rng.chance(50) { rng.ids() } else { Vec::new() },
                    params: rng.chance(90).then(|| random_params(&mut rng)),
                    ..Default::default()
                };
                client.generate(request).await.map(|r| Some(r.into_inner()))
            }
            5..=6 => {
                let messages = (0..rng.below(4))
                    .map(|_| pb::ChatMessage { role: ["user", "system", "assistant", ""][rng.below(4) as usize].into(), content: rng.text(), ..Default::default() })
                    .collect();
                let request = pb::ChatRequest { model, messages, params: rng.chance(90).then(|| random_params(&mut rng)), ..Default::default() };
                client.chat(request).await.map(|r| Some(r.into_inner()))
            }
            7 => client
                .tokenize(pb::TokenizeRequest { model, text: rng.text(), add_special_tokens: rng.chance(50) })
                .await
                .map(|_| None),
            _ => client.model_info(pb::ModelInfoRequest { model }).await.map(|_| None),
        };
        match result {
            Ok(stream) => {
                accepted += 1;
                if let Some(mut stream) = stream {
                    // Read a little, then drop: exercises cancellation too.
                    for _ in 0..rng.below(4) {
                        match stream.message().await {
                            Ok(Some(_)) => {}
                            Ok(None) => break,
                            Err(status) => {
                                assert!(acceptable(status.code()) || status.code() == Code::Unavailable, "case {case}: stream error {status:?}");
                                break;
                            }
                        }
                    }
                }
            }
            // The client library lost its connection before the request reached the server
            // (hyper reports it as Cancelled with a transport source): that is no verdict of
            // the server's, so reconnect and go on; the count is checked below.
            Err(status) if status.code() == Code::Cancelled && std::error::Error::source(&status).is_some() => {
                transport_errors += 1;
                client = GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap());
            }
            Err(status) => {
                refused += 1;
                *codes.entry(format!("{:?}", status.code())).or_default() += 1;
                assert!(acceptable(status.code()), "case {case}: {:?}: {} ({status:?})", status.code(), status.message());
                assert!(!status.message().is_empty(), "case {case}: refusal without a message");
            }
        }
    }
    println!(
        "public API: {CASES} random requests, {accepted} accepted, {refused} refused with actionable codes \
         {codes:?}, {transport_errors} lost client connections"
    );
    // Every case was answered one way or the other, and the generator reached both sides and
    // every kind of refusal (a fuzzer stuck on one path would pass without testing anything).
    assert_eq!(accepted + refused + transport_errors, CASES);
    assert!(transport_errors * 50 <= CASES, "too many lost connections: {transport_errors}");
    assert!(accepted * 10 >= CASES && refused * 10 >= CASES, "accepted {accepted}, refused {refused}");
    for code in ["InvalidArgument", "NotFound", "OutOfRange"] {
        assert!(codes.get(code).is_some_and(|&n| n > 0), "no request was refused with {code}: {codes:?}");
    }
    // Still serving, and still exact.
    common::wait_serving(&server.address, Duration::from_secs(10));
    let prompt = &common::expected("qwen3_a")[2];
    let (stdout, ok) = server.generate(&[
        "--prompt-ids", &common::ids_arg(&prompt.ids), "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", "16",
    ]);
    assert!(ok);
    assert_eq!(common::parse_json_stream(&stdout).0, prompt.greedy_new_ids);
}

/// config.json: random mutations of a real config never panic the parser.
#[test]
fn config_parser_survives_mutations() {
    const CASES: usize = 5000;
    let original = std::fs::read_to_string(common::fixture("qwen3_a").join("config.json")).unwrap();
    let value: serde_json::Value = serde_json::from_str(&original).unwrap();
    let keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
    let mut rng = Rng(0xC0_F1_6);
    let mut accepted = 0;
    for _ in 0..CASES {
        let text = match rng.below(4) {
            0 => {
                let mut bytes = original.clone().into_bytes();
                for _ in 0..1 + rng.below(8) {
                    let at = rng.below(bytes.len() as u64) as usize;
                    bytes[at] = rng.next() as u8;
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            1 => original[..rng.below(original.len() as u64) as usize].to_owned(),
            _ => {
                let mut mutated = value.clone();
                let object = mutated.as_object_mut().unwrap();
                for _ in 0..1 + rng.below(4) {
                    let key = &keys[rng.below(keys.len() as u64) as usize];
                    let replacement = match rng.below(8) {
                        0 => serde_json::Value::Null,
                        1 => serde_json::json!(-1),
                        2 => serde_json::json!(u64::MAX),
                        3 => serde_json::json!(0),
                        4 => serde_json::json!("text"),
                        5 => serde_json::json!([1, 2, 3]),
                        6 => serde_json::json!({"rope_theta": -5, "rope_type": "yarn"}),
                        _ => {
                            object.remove(key);
                            continue;
                        }
                    };
                    object.insert(key.clone(), replacement);
                }
                mutated.to_string()
            }
        };
        if tpserve::model::ModelConfig::from_json_str(&text).is_ok() {
            accepted += 1;
        }
    }
    println!("config.json: {CASES} mutations, {accepted} still valid, none panicked");
    // Mutations must reach both the accepting and the refusing paths.
    assert!(accepted * 20 >= CASES && accepted * 20 <= CASES * 19, "{accepted} of {CASES} valid");
}

/// safetensors: corrupted headers, truncations and garbage never panic the loader.
#[test]
fn safetensors_loader_survives_corruption() {
    const CASES: usize = 400;
    let source = common::fixture("qwen3_a");
    let original = std::fs::read(source.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(source.join("config.json"), dir.path().join("config.json")).unwrap();
    let mut rng = Rng(0x5AFE_7E_AB);
    let (mut loaded, mut refused) = (0, 0);
    for _ in 0..CASES {
        let mut bytes = original.clone();
        match rng.below(5) {
            0 => bytes.truncate(rng.below(bytes.len() as u64) as usize),
            1 => {
                // Flip bytes inside the JSON header (names, dtypes, shapes, offsets).
                for _ in 0..1 + rng.below(6) {
                    let at = 8 + rng.below(header_len as u64) as usize;
                    bytes[at] = b"0123456789[]{},:\"FBI"[rng.below(20) as usize];
                }
            }
            2 => {
                let bogus = rng.next() % (bytes.len() as u64 * 2);
                bytes[..8].copy_from_slice(&bogus.to_le_bytes());
            }
            3 => bytes = (0..rng.below(4096)).map(|_| rng.next() as u8).collect(),
            _ => {
                // Valid header, garbage data: must load (values are just numbers) or refuse.
                for byte in bytes[8 + header_len..].iter_mut().step_by(7) {
                    *byte = rng.next() as u8;
                }
            }
        }
        std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        let options = tpserve::model::LoadOptions { dtype: Some(candle_core::DType::F32), device: candle_core::Device::Cpu, products: tpserve::model::Products::Exact };
        let group = tpserve::model::parallel::TpGroup::single();
        match tpserve::model::Model::load(dir.path(), &group, &options, Arc::new(Default::default())) {
            Ok(_) => loaded += 1,
            Err(err) => {
                refused += 1;
                assert!(!format!("{err:#}").is_empty());
            }
        }
    }
    println!("safetensors: {CASES} corrupted files, {loaded} loaded, {refused} refused with errors, none panicked");
    assert_eq!(loaded + refused, CASES);
    assert!(loaded * 20 >= CASES && refused * 20 >= CASES, "loaded {loaded}, refused {refused}");
}

/// A rank driven directly with random GenerateSteps (unknown models, out-of-vocabulary ids,
/// skipped positions, duplicate sequences, wild sampling parameters) refuses what is wrong,
/// and afterwards still computes the reference output.
#[tokio::test(flavor = "multi_thread")]
async fn rank_survives_random_steps() {
    use tpserve::proto::rank::v1 as rank_pb;
    use tpserve::proto::rank::v1::rank_client::RankClient;
    const CASES: usize = 500;

    let dir = tempfile::tempdir().unwrap();
    let address = format!("unix://{}", dir.path().join("rank.sock").display());
    let mut rank = common::tpserve()
        .args(["rank", "--listen", &address, "--threads", "1"])
        .arg("--rendezvous")
        .arg(format!("unix://{}", dir.path().join("comm.sock").display()))
        .env_remove("TPSERVE_CLUSTER_TOKEN")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, Duration::from_secs(30));
    let parsed: Address = address.parse().unwrap();
    let mut client = RankClient::new(net::connect(&parsed, Duration::from_secs(10)).await.unwrap());
    let comm_id = client.create_comm_id(rank_pb::CreateCommIdRequest { epoch: 1 }).await.unwrap().into_inner().comm_id;
    client
        .init(rank_pb::InitRequest { rank: 0, world_size: 1, comm_id, epoch: 1, timeout_ms: 10_000 })
        .await
        .unwrap();
    let load = rank_pb::LoadShardRequest {
        model_id: "m".into(),
        model_path: common::fixture("qwen3_a").display().to_string(),
        dtype: "f32".into(),
        epoch: 1,
        quantize: String::new(),
        matmul_precision: String::new(),
        kv_cache_dtype: String::new(),
        kv_block_size: 16,
        kv_blocks: 0,
    };
    let mut progress = client.load_shard(load).await.unwrap().into_inner();
    while let Some(message) = progress.message().await.unwrap() {
        if message.done {
            break;
        }
    }

    let mut rng = Rng(0xBAD_5EED);
    let (mut ok, mut refused) = (0, 0);
    for case in 0..CASES {
        let sequences = (0..1 + rng.below(4))
            .map(|_| {
                let params = random_params(&mut rng);
                let seq_id = rng.below(6);
                // Each sequence its own 40 blocks (640 positions); sometimes a table that is too
                // short or names a block outside any pool.
                let mut block_table: Vec<u32> = (0..40).map(|b| (seq_id * 40 + b) as u32).collect();
                if rng.chance(5) {
                    block_table.truncate(rng.below(4) as usize);
                }
                if rng.chance(3) {
                    block_table.push(u32::MAX);
                }
                rank_pb::SequenceStep {
                    seq_id,
                    block_table,
                    token_ids: rng.ids().into_iter().take(300).collect(),
                    start_pos: if rng.chance(70) { 0 } else { rng.next() as u32 % 5000 },
                    prompt_len: rng.next() as u32 % 400,
                    sample: rng.chance(70),
                    sampling: Some(rank_pb::SamplingParams {
                        temperature: params.temperature.unwrap_or(0.0),
                        top_k: params.top_k.unwrap_or(0),
                        top_p: params.top_p.unwrap_or(1.0),
                        min_p: params.min_p.unwrap_or(0.0),
                        repetition_penalty: params.repetition_penalty.unwrap_or(1.0),
                        presence_penalty: params.presence_penalty.unwrap_or(0.0),
                        frequency_penalty: params.frequency_penalty.unwrap_or(0.0),
                        seed: params.seed.unwrap_or(0),
                        top_logprobs: params.top_logprobs,
                        logprobs: params.logprobs,
                        suppressed_token_ids: (0..rng.below(3)).map(|_| rng.next() as u32).collect(),
                    }),
                    ..Default::default()
                }
            })
            .collect();
        let request = rank_pb::GenerateStepRequest {
            model_id: if rng.chance(5) { "other".into() } else { "m".into() },
            step: case as u64,
            epoch: if rng.chance(5) { 7 } else { 1 },
            sequences,
            dropped_snapshots: if rng.chance(5) { vec![rng.next() as u32] } else { Vec::new() },
        };
        match client.generate_step(request).await {
            Ok(_) => ok += 1,
            Err(status) => {
                refused += 1;
                assert!(acceptable(status.code()), "case {case}: {:?}: {} ({status:?})", status.code(), status.message());
            }
        }
    }
    println!("rank: {CASES} random steps, {ok} ran, {refused} refused with actionable codes");
    assert_eq!(ok + refused, CASES);
    assert!(ok > 0 && refused * 2 >= CASES, "{ok} ran, {refused} refused: the generator must reach both");

    // A cached sequence listed twice in one step: refused, not a subtraction that underflows
    // in the rank's capacity check (once a panic that killed its device worker).
    let step = |step: u64, sequences: Vec<(u32, usize)>| rank_pb::GenerateStepRequest {
        model_id: "m".into(),
        step,
        epoch: 1,
        dropped_snapshots: Vec::new(),
        sequences: sequences
            .into_iter()
            .map(|(start_pos, len)| rank_pb::SequenceStep {
                seq_id: 77,
                token_ids: vec![5; len],
                start_pos,
                sample: false,
                block_table: (0..4).collect(),
                ..Default::default()
            })
            .collect(),
    };
    client.generate_step(step(9_000, vec![(0, 50)])).await.unwrap();
    let status = client.generate_step(step(9_001, vec![(0, 1), (0, 1)])).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("appears twice"), "{}", status.message());

    // Not wedged: clear everything and reproduce the reference greedy tokens step by step.
    client.clear_kv(rank_pb::ClearKvRequest { model_id: "m".into(), seq_ids: vec![], all: true }).await.unwrap();
    let prompt = &common::expected("qwen3_a")[0];
    let greedy = rank_pb::SamplingParams { top_p: 1.0, repetition_penalty: 1.0, suppressed_token_ids: vec![2], ..Default::default() };
    let mut tokens = prompt.ids.clone();
    let mut fed = 0;
    let mut generated = Vec::new();
    for step in 0..16u64 {
        let request = rank_pb::GenerateStepRequest {
            model_id: "m".into(),
            step: 10_000 + step,
            epoch: 1,
            sequences: vec![rank_pb::SequenceStep {
                seq_id: 42,
                token_ids: tokens[fed..].to_vec(),
                start_pos: fed as u32,
                prompt_len: prompt.ids.len() as u32,
                sample: true,
                sampling: Some(greedy.clone()),
                block_table: (0..tokens.len().div_ceil(16) as u32).collect(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let response = client.generate_step(request).await.unwrap().into_inner();
        fed = tokens.len();
        let token = response.tokens[0].token_id;
        tokens.push(token);
        generated.push(token);
    }
    assert_eq!(generated, prompt.greedy_new_ids);
    common::terminate(&mut rank);
}
