//! Automatic prefix caching on the paged KV cache, through real `tpserve serve` processes: hits
//! (ending at a block boundary inside a longer shared prefix, for Qwen3, Qwen3 MoE and the
//! Qwen3.5 hybrids, whose Gated DeltaNet state is restored from a snapshot) give the oracle's
//! greedy ids and the same ids as a server with the cache off, at TP 1 and 2; conversations that
//! diverge after a shared prefix; eviction under a deliberately small pool; a cancelled prefill
//! freeing its blocks; and recovery from kill -9 of a rank while cached prefixes are in use.

mod common;

use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

const FAMILIES: [&str; 4] = ["qwen3_a", "qwen3_moe", "qwen3_5_dense", "qwen3_5_moe"];

async fn client(address: &str) -> GeneratorClient<Channel> {
    let address: Address = address.parse().unwrap();
    GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap())
}

fn greedy(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt_ids: prompt,
        params: Some(pb::GenerationParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn run(address: &str, request: pb::GenerateRequest) -> Vec<u32> {
    let mut stream = client(address).await.generate(request).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        ids.extend(message.token_id);
    }
    ids
}

async fn info(address: &str) -> pb::ModelInfoResponse {
    client(address).await.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner()
}

/// `prefix` followed by in-vocabulary filler that differs from what follows it in prompt 2.
fn diverging(prefix: &[u32], len: usize, salt: u32) -> Vec<u32> {
    let mut ids = prefix.to_vec();
    ids.extend((0..len as u32).map(|i| 3 + (i * 7 + salt) % 400));
    ids
}

/// A multi-turn shaped workload over the oracle's prompts. Which requests have a reference:
/// (request, Some(index of the oracle prompt)).
fn conversation(name: &str) -> Vec<(pb::GenerateRequest, Option<usize>)> {
    let expected = common::expected(name);
    let long = &expected[2].ids; // 165 tokens
    vec![
        // Warms the cache: 6 full blocks (96 positions); hybrids snapshot their state at 96.
        (greedy(long[..100].to_vec(), 4), None),
        // Shares 40 tokens, diverging inside the third block: 2 blocks shareable.
        (greedy(diverging(&long[..40], 30, 1), 6), None),
        // The reference prompt, hitting 96 cached positions.
        (greedy(long.clone(), 16), Some(2)),
        // Again: now 160 positions are cached (hybrids: the snapshot its own prefill took).
        (greedy(long.clone(), 16), Some(2)),
        (greedy(expected[0].ids.clone(), 16), Some(0)),
        (greedy(expected[1].ids.clone(), 16), Some(1)),
        // Another conversation diverging after the shared 40 tokens.
        (greedy(diverging(&long[..40], 50, 2), 8), None),
        (greedy(diverging(&long[..100], 20, 3), 8), None),
        // Penalties on a hit must count the cached prompt tokens too (the ranks get them with
        // the first step). Greedy: a seeded draw could flip on the last-bit differences that
        // batching and chunking make, which are not what this checks.
        (penalized(long.clone(), 16), None),
    ]
}

fn penalized(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    let mut request = greedy(prompt, max_tokens);
    request.params = Some(pb::GenerationParams {
        repetition_penalty: Some(1.5),
        presence_penalty: Some(1.0),
        frequency_penalty: Some(0.5),
        ..request.params.unwrap_or_default()
    });
    request
}

/// The conversation on a server with the cache on and one with it off: identical ids, and the
/// oracle's ids where it has them; the cache really hit; then all of it at once (hits on blocks
/// that running sequences share) gives the same ids again.
async fn check_family(name: &str, tp: usize) {
    let flags = ["--prefill-chunk", "64", "--max-batch-size", "16"];
    let on = common::Served::start_with(name, tp, &flags);
    let off = common::Served::start_with(name, tp, &[&flags[..], &["--prefix-cache", "off"]].concat());
    let expected = common::expected(name);
    let mut outputs = Vec::new();
    for (i, (request, reference)) in conversation(name).into_iter().enumerate() {
        let with_cache = run(&on.address, request.clone()).await;
        let without = run(&off.address, request).await;
        assert_eq!(with_cache, without, "{name} TP {tp} request {i}: cache on and off differ");
        if let Some(prompt) = reference {
            assert_eq!(with_cache, expected[prompt].greedy_new_ids, "{name} TP {tp} request {i}: not the oracle's ids");
        }
        outputs.push(with_cache);
    }
    let cached = info(&on.address).await;
    println!("{name} TP {tp}: {} of {} prompt tokens hit the cache", cached.prefix_cache_hits_total, cached.prefix_cache_queries_total);
    // At least the two hits on the reference prompt (96 + 160 positions).
    assert!(cached.prefix_cache_enabled && cached.prefix_cache_hits_total >= 96 + 160, "{name} TP {tp}: {cached:?}");
    assert_eq!(cached.kv_blocks_used, 0, "{name} TP {tp}: blocks held after every request ended: {cached:?}");
    let uncached = info(&off.address).await;
    assert!(!uncached.prefix_cache_enabled && uncached.prefix_cache_hits_total == 0 && uncached.kv_blocks_cached == 0, "{uncached:?}");

    let tasks: Vec<_> = conversation(name)
        .into_iter()
        .map(|(request, _)| {
            let address = on.address.clone();
            tokio::spawn(async move { run(&address, request).await })
        })
        .collect();
    for (i, (task, alone)) in tasks.into_iter().zip(&outputs).enumerate() {
        assert_eq!(&task.await.unwrap(), alone, "{name} TP {tp} request {i}: differs in a batch");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn hits_match_the_oracle_and_the_uncached_server_at_tp1() {
    for name in FAMILIES {
        check_family(name, 1).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn hits_match_the_oracle_and_the_uncached_server_at_tp2() {
    for name in FAMILIES {
        check_family(name, 2).await;
    }
}

/// A pool of 24 blocks (qwen3_a at TP 2: 16 KiB per block per rank): three prompts of 11-12
/// blocks each cannot all stay cached, so the least recently used blocks are evicted, the pool
/// never holds more than it has, and the evicted prompt still gives the oracle's ids.
#[tokio::test(flavor = "multi_thread")]
async fn cached_blocks_are_evicted_when_the_pool_runs_short() {
    let budget_gib = format!("{}", 24.0 * 16384.0 / (1u64 << 30) as f64);
    let server = common::Served::start_with("qwen3_a", 2, &["--kv-cache-gib", &budget_gib]);
    let expected = common::expected("qwen3_a");
    let reference = greedy(expected[2].ids.clone(), 16);
    assert_eq!(run(&server.address, reference.clone()).await, expected[2].greedy_new_ids);
    let first = info(&server.address).await;
    assert_eq!(first.kv_blocks_total, 24, "{first:?}");
    assert!(first.kv_blocks_cached >= 10, "the prompt's full blocks stay cached: {first:?}");
    for salt in [11, 12] {
        run(&server.address, greedy(diverging(&[], 150, salt), 16)).await;
        let now = info(&server.address).await;
        assert!(now.kv_blocks_used + now.kv_blocks_cached <= 24, "{now:?}");
    }
    let before = info(&server.address).await.prefix_cache_hits_total;
    assert_eq!(run(&server.address, reference).await, expected[2].greedy_new_ids);
    let hits = info(&server.address).await.prefix_cache_hits_total - before;
    assert!(hits < 160, "the prompt's tail blocks should have been evicted, yet {hits} tokens hit");
}

/// A client that goes away in the middle of a long chunked prefill: its blocks are freed (none
/// used, none reserved), and the server goes on serving exact output.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_prefill_frees_its_blocks() {
    let server = common::Served::start_with("qwen3_a", 2, &["--prefill-chunk", "16"]);
    let mut stream_client = client(&server.address).await;
    let stream = stream_client.generate(greedy(diverging(&[], 3000, 5), 4)).await.unwrap().into_inner();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = info(&server.address).await;
        if now.kv_blocks_used > 0 && now.kv_cached_tokens > 0 {
            assert!(now.kv_blocks_reserved > 0, "a prefill under way still holds its reservation: {now:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the prefill never started: {now:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(stream);
    drop(stream_client);
    loop {
        let now = info(&server.address).await;
        if now.active_sequences == 0 {
            assert_eq!((now.kv_blocks_used, now.kv_blocks_reserved, now.kv_reserved_tokens), (0, 0, 0), "{now:?}");
            assert!(now.requests_cancelled_total >= 1, "{now:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the cancelled sequence was never freed: {now:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let expected = common::expected("qwen3_a");
    assert_eq!(run(&server.address, greedy(expected[0].ids.clone(), 16)).await, expected[0].greedy_new_ids);
}

/// kill -9 of a rank while a Qwen3.5 request runs from a cached prefix (blocks and a DeltaNet
/// snapshot): the group recovers, the caches are dropped with the epoch, the sequence
/// re-prefills and ends with the ids of an undisturbed run, which match the oracle.
#[tokio::test(flavor = "multi_thread")]
async fn recovery_after_kill_9_with_cached_prefixes_gives_identical_ids() {
    let name = "qwen3_5_dense";
    let server = common::Served::start(name, 2);
    let expected = common::expected(name);
    // Long enough that the kill lands mid-stream.
    let request = greedy(expected[2].ids.clone(), 1500);
    let undisturbed = run(&server.address, request.clone()).await;
    assert_eq!(undisturbed[..16], expected[2].greedy_new_ids[..]);
    let hits_before = info(&server.address).await.prefix_cache_hits_total;

    let mut stream = client(&server.address).await.generate(request.clone()).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while ids.len() < 5 {
        ids.extend(stream.message().await.unwrap().expect("the stream ended early").token_id);
    }
    assert!(info(&server.address).await.prefix_cache_hits_total > hits_before, "the second run must hit the cache");
    // SAFETY: kill(2) on the pid of our own child's child; no memory is involved.
    unsafe { libc::kill(common::rank_pid(server.child.id(), 1), libc::SIGKILL) };
    while let Some(message) = stream.message().await.unwrap() {
        ids.extend(message.token_id);
    }
    assert_eq!(ids, undisturbed, "the resumed stream differs from the undisturbed run");
    let log = server.log();
    assert_eq!(log.matches("rank group lost; recovering").count(), 1, "one lost rank, one recovery:\n{log}");
    // After recovery the cache fills again and still gives the same ids.
    assert_eq!(run(&server.address, request.clone()).await, undisturbed);
    assert_eq!(run(&server.address, request).await, undisturbed);
}
