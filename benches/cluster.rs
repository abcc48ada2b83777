//! Cluster throughput: prompts a second through `sdkit serve --queue`
//! with 1, 2 and 4 CPU workers, beside the single-process server measured
//! in the same run, on weightless image prompts (what a job costs the
//! queue: Redis round trips, token claims, the relay) and on the tiny SD1
//! checkpoint (64², 3 steps).
//!
//! `cargo bench --bench cluster` (needs `redis-server` on PATH). The
//! workers share this machine's cores, so more workers than cores adds
//! no throughput here; the overhead per job is the figure to read.

#[path = "../tests/support/mod.rs"]
mod support;

use serde_json::{json, Value as Json};
use std::path::Path;
use std::time::{Duration, Instant};
use support::cluster::*;
use support::http::*;

/// Queues `prompts` and waits for all of them; the wall time.
fn batch(addr: &str, prompts: &[Json]) -> Duration {
    let mut ws = ws_connect(addr, "bench");
    let t0 = Instant::now();
    let ids = prompts
        .iter()
        .map(|p| {
            let r = post_json(addr, "/prompt", &json!({"prompt": p, "client_id": "bench"}));
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            r.json()["prompt_id"].as_str().expect("id").to_string()
        })
        .collect();
    follow_all(&mut ws, ids);
    t0.elapsed()
}

/// The wall time of `prompts` on a fresh server with `workers` workers
/// (0: the single-process server), after a warm-up batch.
fn measure(
    base: &Path,
    redis_port: u16,
    workers: usize,
    warm: &[Json],
    prompts: &[Json],
) -> Duration {
    let queue = format!("redis://127.0.0.1:{redis_port}");
    redis(redis_port, &["FLUSHALL"]);
    let (_api, addr) = serve((workers > 0).then_some(queue.as_str()), base);
    let _workers: Vec<Proc> = (0..workers)
        .map(|i| worker(&queue, base, &format!("bench{i}")))
        .collect();
    batch(&addr, warm);
    batch(&addr, prompts)
}

fn main() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((_redis, port)) = start_redis(base.path()) else {
        eprintln!("cluster bench: redis-server is not installed");
        std::process::exit(1);
    };
    support::write_base_checkpoints(&base.path().join("models"));
    let n_small = 60;
    let n_sd1 = 16;
    let small_prompts: Vec<Json> = (0..n_small).map(|i| small(i, &format!("s{i}"))).collect();
    let sd1: Vec<Json> = (0..n_sd1)
        .map(|i| prompt("tiny_sd1_txt2img", i as u64, &format!("sd1_{i}")))
        .collect();
    let warm_small: Vec<Json> = (0..8).map(|i| small(900 + i, "warm")).collect();
    let warm_sd1: Vec<Json> = (0..8)
        .map(|i| prompt("tiny_sd1_txt2img", 900 + i, "warm"))
        .collect();
    println!(
        "{:<22} {:>14} {:>10} {:>16} {:>10}",
        "workload", "setup", "jobs/s", "ms/job", "vs single"
    );
    for (name, warm, prompts) in [
        ("image ops 32x24", &warm_small, &small_prompts),
        ("tiny SD1 64², 3 steps", &warm_sd1, &sd1),
    ] {
        let mut single = None;
        for workers in [0, 1, 2, 4] {
            let t = measure(base.path(), port, workers, warm, prompts);
            let per = t.as_secs_f64() * 1000.0 / prompts.len() as f64;
            let single_per = *single.get_or_insert(per);
            let setup = if workers == 0 {
                "single process".to_string()
            } else {
                format!("{workers} worker{}", if workers == 1 { "" } else { "s" })
            };
            println!(
                "{name:<22} {setup:>14} {:>10.2} {per:>16.1} {:>9.2}x",
                1000.0 / per,
                single_per / per,
            );
        }
    }
}
