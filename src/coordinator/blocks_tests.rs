use super::*;

fn geometry(blocks: usize, state_units: usize) -> PoolGeometry {
    PoolGeometry { blocks, block_size: 4, state_units, recurrent: state_units > 0 }
}

/// Runs a whole sequence through the ledger: admit with the best hit, fill every position,
/// register, release. Returns the hit's length in tokens.
fn serve(manager: &mut BlockManager, tokens: &[u32]) -> usize {
    let hit = manager.lookup(tokens);
    let hit_tokens = hit.tokens(4);
    let mut seq = manager.admit(&hit, tokens.len()).expect("fits");
    manager.grow(&mut seq, tokens.len()).unwrap();
    manager.register(&mut seq, tokens, tokens.len());
    manager.release(seq);
    hit_tokens
}

#[test]
fn admission_commits_blocks_and_recurrent_state() {
    let mut manager = BlockManager::new(geometry(10, 2), true, "m");
    // 9 tokens: 3 blocks + 2 for the state.
    let first = manager.admit(&Hit::default(), 9).unwrap();
    assert_eq!(manager.committed(), 5);
    let second = manager.admit(&Hit::default(), 9).unwrap();
    assert_eq!(manager.committed(), 10);
    assert!(manager.admit(&Hit::default(), 1).is_none(), "the pool is fully committed");
    manager.release(first);
    manager.release(second);
    assert_eq!(manager.committed(), 0);
    assert!(manager.fits_ever(32) && !manager.fits_ever(33));
    assert_eq!(manager.geometry().max_sequence_tokens(), 32);
}

#[test]
fn a_prompt_reuses_full_blocks_of_a_cached_prefix_but_never_all_of_itself() {
    let mut manager = BlockManager::new(geometry(32, 0), true, "m");
    let system: Vec<u32> = (1..=10).collect();
    assert_eq!(serve(&mut manager, &system), 0);
    assert_eq!(manager.usage().cached, 2, "the two full blocks stay cached; the partial one is freed");
    // Same 10 tokens then more: two blocks hit (the third was partial and never shared).
    let mut longer = system.clone();
    longer.extend([50, 51, 52, 53, 54]);
    assert_eq!(serve(&mut manager, &longer), 8);
    // A prompt of exactly the cached 8 tokens reuses only one block: one token must run.
    assert_eq!(serve(&mut manager, &system[..8]), 4);
    // Diverging inside the second block: only the first block is shared.
    let diverged = [1, 2, 3, 4, 5, 99, 7, 8, 9];
    assert_eq!(serve(&mut manager, &diverged), 4);
    // Another model's keys never match.
    let mut other = BlockManager::new(geometry(32, 0), true, "other");
    assert_eq!(serve(&mut other, &system), 0);
    // With the cache off nothing is kept.
    let mut off = BlockManager::new(geometry(32, 0), false, "m");
    serve(&mut off, &system);
    assert_eq!((serve(&mut off, &system), off.usage().cached), (0, 0));
}

#[test]
fn cached_blocks_are_evicted_least_recently_used_when_the_pool_runs_short() {
    let mut manager = BlockManager::new(geometry(6, 0), true, "m");
    let a: Vec<u32> = (1..=9).collect(); // 2 full blocks cached
    let b: Vec<u32> = (100..109).collect();
    serve(&mut manager, &a);
    serve(&mut manager, &b);
    assert_eq!(manager.usage().cached, 4);
    // a is used again, so b is now the least recently used.
    assert_eq!(serve(&mut manager, &a), 8);
    // 12 tokens need 3 blocks beyond the 2 free: one cached block must go, and it is b's tail
    // (a tail without its head is useless).
    let c: Vec<u32> = (200..212).collect();
    let mut seq = manager.admit(&Hit::default(), c.len()).unwrap();
    manager.grow(&mut seq, c.len()).unwrap();
    assert_eq!(manager.usage().cached, 3);
    assert_eq!(manager.lookup(&b).tokens(4), 4, "b keeps its head block");
    assert_eq!(manager.lookup(&a).tokens(4), 8, "a was used more recently and is intact");
    manager.release(seq);
    let usage = manager.usage();
    assert!(usage.used + usage.cached <= 6, "{usage:?}");
}

#[test]
fn hybrid_hits_end_at_a_snapshot_and_evicted_snapshots_are_dropped() {
    let mut manager = BlockManager::new(geometry(12, 1), true, "m");
    let prompt: Vec<u32> = (1..=11).collect();
    let boundary = manager.snapshot_boundary(prompt.len(), 0).unwrap();
    assert_eq!(boundary, 8);
    let mut seq = manager.admit(&Hit::default(), prompt.len() + 4).unwrap();
    manager.grow(&mut seq, boundary).unwrap();
    let snapshot = manager.take_snapshot(&seq, &prompt, boundary).unwrap();
    assert_eq!(snapshot, seq.table[1]);
    manager.register(&mut seq, &prompt, boundary);
    manager.grow(&mut seq, prompt.len()).unwrap();
    manager.register(&mut seq, &prompt, prompt.len());
    manager.release(seq);
    // Both full blocks are cached but only the second carries a snapshot: the hit is 8 tokens.
    let hit = manager.lookup(&prompt);
    assert_eq!((hit.tokens(4), hit.last_block()), (8, Some(snapshot)));
    // Without the snapshot there is no usable hit at all.
    manager.forget_snapshot(snapshot);
    assert_eq!(manager.take_dropped(), vec![snapshot]);
    assert_eq!(manager.lookup(&prompt).tokens(4), 0);
}
