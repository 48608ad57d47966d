//! A simulated multi-channel video pipeline on the pool, end to end on the simulator:
//! bitstream packets copied host -> DVPP, decoded NV12 frames, a resize into 128-aligned
//! model inputs, model outputs copied to pinned host memory — then the pool's statistics.
//!
//! `cargo run --release --example video_pipeline -- [channels] [frames per channel]`

use ascend_pool::region::{DvppInput, DvppOutput, ModelInput, SubRegion};
use ascend_pool::source::sim::SimSource;
use ascend_pool::{MemKind, Pool, PoolConfig};
use std::sync::Arc;

mod common;

const WIDTH: u64 = 1920;
const HEIGHT: u64 = 1080;
const FRAME: u64 = WIDTH * HEIGHT * 3 / 2; // NV12
const MODEL_INPUT: u64 = 640 * 640 * 3 / 2;
const MODEL_OUTPUT: u64 = 25_200 * 85 * 2; // fp16 detections

/// Stand-in for the decoder: it only accepts DVPP memory on both sides.
fn vdec(
    pool: &Pool,
    packet: &impl DvppInput,
    frame: &mut impl DvppOutput,
    seq: u8,
    stream: &ascend_pool::Stream,
) -> ascend_pool::Result<()> {
    let _ = packet.len();
    pool.memset_async(frame, 0, seq, FRAME, stream)
}

/// Stand-in for the model: its input must be 128-aligned, which the type guarantees.
fn infer(
    pool: &Pool,
    input: &impl ModelInput,
    output: &mut ascend_pool::DeviceRegion,
    stream: &ascend_pool::Stream,
) -> ascend_pool::Result<()> {
    assert_eq!(input.addr() % 128, 0);
    pool.copy_async(output, 0, input, 0, 4096, stream)
}

fn main() -> ascend_pool::Result<()> {
    let counts = common::counts("video_pipeline [channels] [frames per channel]", &[8, 120])?;
    let (channels, frames) = (counts[0], counts[1]);
    let pool = Arc::new(Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::from_env()?,
    )?);
    let start = std::time::Instant::now();
    let workers: Vec<_> = (0..channels)
        .map(|ch| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || -> ascend_pool::Result<u64> {
                let stream = pool.create_stream()?;
                let mut checked = 0;
                // A few frames stay referenced (B-frame reordering) before they are freed.
                let mut reorder = std::collections::VecDeque::new();
                for f in 0..frames {
                    let seq = (ch * 31 + f) as u8;
                    let packet_len = 20_000 + (ch * 7919 + f * 104_729) % 50_000;
                    let mut host_packet = pool.alloc_host(packet_len)?;
                    host_packet.as_mut_slice().fill(seq);
                    let mut packet = pool.alloc_dvpp(packet_len)?;
                    pool.copy_async(&mut packet, 0, &host_packet, 0, packet_len, &stream)?;
                    drop(host_packet); // freed behind the stream: reused only once it has run
                    let mut frame = pool.alloc_dvpp(FRAME)?;
                    vdec(&pool, &packet, &mut frame, seq, &stream)?;
                    drop(packet);
                    // Resize: the top-left crop stands in for the scaler's output.
                    let mut input = pool.alloc_dvpp(MODEL_INPUT)?;
                    let crop = SubRegion::new(&mut frame, 0, MODEL_INPUT)?;
                    pool.copy_async(&mut input, 0, &crop, 0, MODEL_INPUT, &stream)?;
                    let mut output = pool.alloc_device(MODEL_OUTPUT)?;
                    infer(&pool, &input, &mut output, &stream)?;
                    let mut result = pool.alloc_host(MODEL_OUTPUT)?;
                    pool.copy_async(&mut result, 0, &output, 0, MODEL_OUTPUT, &stream)?;
                    stream.synchronize()?;
                    assert!(result.as_slice()[..4096].iter().all(|&b| b == seq));
                    checked += 1;
                    reorder.push_back(frame);
                    if reorder.len() > 3 {
                        reorder.pop_front();
                    }
                }
                Ok(checked)
            })
        })
        .collect();
    let mut frames_done = 0;
    for w in workers {
        frames_done += w.join().expect("channel thread")?;
    }
    let elapsed = start.elapsed();
    // Frees still waiting behind streams complete here.
    pool.synchronize()?;
    pool.validate()?;
    println!(
        "{channels} channels x {frames} frames: {frames_done} frames checked in {:.2?}",
        elapsed
    );
    common::print_kind_table(&pool);
    let dvpp = pool.stats(MemKind::Dvpp);
    println!(
        "dvpp utilization at peak: {:.3} (peak allocated / peak reserved)",
        dvpp.peak_allocated_bytes as f64 / dvpp.peak_reserved_bytes as f64
    );
    assert!(pool.leak_report().is_empty());
    Ok(())
}
