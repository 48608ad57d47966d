//! A simulated LLM inference server on the pool, end to end on the simulator: worker threads,
//! each with its own stream, serve requests in continuous batches. A request's prompt goes
//! from pinned host memory into a 128-aligned model input; its KV cache grows a block at a
//! time as tokens are generated; each decode step's logits are freed behind the stream and
//! taken back on it at once; the answer comes back to pinned host memory and is checked,
//! with every KV block. Then the pool's statistics.
//!
//! `cargo run --release --example inference_server -- [workers] [requests per worker]`

use ascend_pool::{DeviceRegion, MemKind, Pool, PoolConfig, Result, SimSource, Stream};
use std::collections::VecDeque;
use std::sync::Arc;

mod common;

/// Tokens whose keys and values one KV-cache block holds.
const BLOCK_TOKENS: u64 = 16;
/// One block: 16 tokens x 8 layers x (key, value) x 8 heads x 128 dims x fp16 = 512 KiB.
const KV_BLOCK: u64 = BLOCK_TOKENS * 8 * 2 * 8 * 128 * 2;
/// Hidden state of one token, fp16: the prefill's activations take this per prompt token.
const HIDDEN: u64 = 4096 * 2;
/// One decode step's logits over a 32,000-token vocabulary, fp16.
const LOGITS: u64 = 32_000 * 2;
/// Bytes of the answer per generated token: one 64-byte slot, so each token's copy starts
/// where `aclrtMemcpyAsync` wants it.
const SLOT: u64 = 64;
/// Requests a worker keeps in flight, stepped in turn (continuous batching).
const BATCH: usize = 4;

/// A small deterministic generator: every run serves the same requests.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// One request in flight: its KV cache and the device buffer its tokens are written to.
struct Request {
    /// Written into every byte of its KV blocks; never 0, so memory nobody wrote cannot pass.
    tag: u8,
    tokens: u64,
    to_generate: u64,
    generated: u64,
    kv: Vec<DeviceRegion>,
    answer: DeviceRegion,
}

/// The value decode step `step` of a request tagged `tag` writes: the check's expectation.
fn token_value(tag: u8, step: u64) -> u8 {
    tag.wrapping_add(step as u8) | 1
}

/// Takes a request in: the prompt copied to the device, the prefill's activations, the KV
/// blocks the prompt fills. Everything transient is dropped at once: freed behind the stream.
fn admit(pool: &Pool, stream: &Stream, rng: &mut Lcg, tag: u8) -> Result<Request> {
    let prompt = 16 + rng.below(1009);
    let to_generate = 8 + rng.below(121);
    let mut host_prompt = pool.alloc_host(prompt * 4)?;
    host_prompt.as_mut_slice().fill(tag);
    let mut input = pool.alloc_model_input(prompt * 4)?;
    pool.copy_async(&mut input, 0, &host_prompt, 0, prompt * 4, stream)?;
    drop(host_prompt);
    // Stand-in for the prefill: the activations take the input, and the KV blocks the tag.
    let mut activations = pool.alloc_device_on(prompt * HIDDEN, stream)?;
    pool.copy_async(&mut activations, 0, &input, 0, prompt * 4, stream)?;
    drop(input);
    let mut kv = Vec::new();
    for _ in 0..prompt.div_ceil(BLOCK_TOKENS) {
        kv.push(kv_block(pool, stream, tag)?);
    }
    drop(activations);
    Ok(Request {
        tag,
        tokens: prompt,
        to_generate,
        generated: 0,
        kv,
        answer: pool.alloc_device(to_generate * SLOT)?,
    })
}

fn kv_block(pool: &Pool, stream: &Stream, tag: u8) -> Result<DeviceRegion> {
    let mut block = pool.alloc_device_on(KV_BLOCK, stream)?;
    pool.memset_async(&mut block, 0, tag, KV_BLOCK, stream)?;
    Ok(block)
}

/// One decode step: logits, one token written to the answer, a new KV block when the last
/// one is full.
fn step(pool: &Pool, stream: &Stream, r: &mut Request) -> Result<()> {
    let mut logits = pool.alloc_device_on(LOGITS, stream)?;
    pool.memset_async(
        &mut logits,
        0,
        token_value(r.tag, r.generated),
        LOGITS,
        stream,
    )?;
    pool.copy_async(&mut r.answer, r.generated * SLOT, &logits, 0, SLOT, stream)?;
    // Freed behind the stream: the next step's logits take the same bytes, in stream order.
    drop(logits);
    if r.tokens % BLOCK_TOKENS == 0 {
        r.kv.push(kv_block(pool, stream, r.tag)?);
    }
    r.tokens += 1;
    r.generated += 1;
    Ok(())
}

/// Copies the answer back and checks it and the head and tail of every KV block: a block
/// another request was handed too early, or a step reordered, shows here.
fn finish(pool: &Pool, stream: &Stream, r: Request) -> Result<()> {
    let mut back = pool.alloc_host(r.to_generate * SLOT)?;
    pool.copy_async(&mut back, 0, &r.answer, 0, r.to_generate * SLOT, stream)?;
    stream.synchronize()?;
    for (i, slot) in back.as_slice().chunks(SLOT as usize).enumerate() {
        let want = token_value(r.tag, i as u64);
        assert!(
            slot.iter().all(|&b| b == want),
            "token {i} of request {}",
            r.tag
        );
    }
    let mut seen = [0u8; 4096];
    for block in &r.kv {
        for at in [0, KV_BLOCK - seen.len() as u64] {
            pool.copy_to_host(block, at, &mut seen)?;
            assert!(
                seen.iter().all(|&b| b == r.tag),
                "KV block of request {}",
                r.tag
            );
        }
    }
    Ok(())
}

/// Serves `requests` requests on one stream, `BATCH` at a time; returns the tokens generated.
fn serve(pool: &Pool, worker: u64, requests: u64) -> Result<u64> {
    let stream = pool.create_stream()?;
    let mut rng = Lcg(worker.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut in_flight = VecDeque::new();
    let (mut admitted, mut tokens) = (0, 0);
    while admitted < requests || !in_flight.is_empty() {
        while in_flight.len() < BATCH && admitted < requests {
            let tag = ((worker * 37 + admitted) % 255 + 1) as u8;
            in_flight.push_back(admit(pool, &stream, &mut rng, tag)?);
            admitted += 1;
        }
        for _ in 0..in_flight.len() {
            let mut r = in_flight.pop_front().expect("a request in flight");
            step(pool, &stream, &mut r)?;
            if r.generated == r.to_generate {
                tokens += r.generated;
                finish(pool, &stream, r)?;
            } else {
                in_flight.push_back(r);
            }
        }
    }
    Ok(tokens)
}

fn main() -> Result<()> {
    let counts = common::counts(
        "inference_server [workers] [requests per worker]",
        &[4, 128],
    )?;
    let (workers, requests) = (counts[0], counts[1]);
    let pool = Arc::new(Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::from_env()?,
    )?);
    let start = std::time::Instant::now();
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || serve(&pool, w, requests))
        })
        .collect();
    let mut tokens = 0;
    for h in handles {
        tokens += h.join().expect("worker thread")?;
    }
    let elapsed = start.elapsed();
    // Frees still waiting behind streams complete here.
    pool.synchronize()?;
    pool.validate()?;
    let allocations: u64 = pool.all_stats().iter().map(|s| s.allocations).sum();
    println!(
        "{workers} workers x {requests} requests: {tokens} tokens checked, {allocations} \
         allocations in {elapsed:.2?}"
    );
    common::print_kind_table(&pool);
    let device = pool.stats(MemKind::DEVICE);
    println!(
        "device utilization at peak: {:.3} (peak allocated / peak reserved)",
        device.peak_allocated_bytes as f64 / device.peak_reserved_bytes as f64
    );
    assert!(pool.leak_report().is_empty());
    Ok(())
}
