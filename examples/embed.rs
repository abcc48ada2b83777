//! Embedding sdkit: load a workflow, validate it, run it, watch its events.
//!
//! `cargo run --example embed` runs `graphs/image_pipeline.ron` on the
//! example input and writes into a temporary folder.

use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join("sdkit-embed-example");
    let paths = Paths {
        input: root.join("graphs/input"),
        output: out.join("output"),
        temp: out.join("temp"),
        models: out.join("models"),
    };

    let lib = Arc::new(sdkit_nodes::library());
    let text = std::fs::read_to_string(root.join("graphs/image_pipeline.ron"))?;
    let wf = sdkit_schema::workflow::load(&text, &lib.registry).map_err(|d| format!("{d:?}"))?;
    let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).map_err(|diags| {
        diags
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    })?;

    let events: EventSink = Arc::new(|e: &Event| {
        if let Event::Executed { node, output, .. } = e {
            println!("{node} -> {output}");
        }
    });
    let exec = Executor::new(lib, Arc::new(paths));
    let rt = tokio::runtime::Runtime::new()?;
    let report = rt.block_on(exec.run(&graph, RunOptions::new(events, CancelToken::new())))?;
    println!(
        "executed {:?}; outputs in {}",
        report.executed,
        out.display()
    );
    Ok(())
}
