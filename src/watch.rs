//! `sdkit watch`: run, then re-validate and re-run on every save.
//!
//! The parent folder is watched rather than the file, because editors often
//! save by writing a temporary file and renaming it over the original, which
//! replaces the inode a file watch would follow. The executor (and its cache)
//! lives across runs, so a re-run executes only changed nodes.

use crate::cli::{event_sink, load_and_validate, print_diagnostics, run_graph, Loaded, RunArgs};
use anyhow::{Context, Result};
use notify::{RecursiveMode, Watcher};
use sdkit_engine::CancelToken;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Quiet period after a change before re-running, so an editor's burst of
/// writes becomes one run.
const DEBOUNCE: Duration = Duration::from_millis(150);

pub fn watch(args: RunArgs) -> Result<i32> {
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(watch_async(args))
}

async fn watch_async(args: RunArgs) -> Result<i32> {
    let lib = Arc::new(sdkit_nodes::library());
    let paths = args.dirs.paths()?;
    crate::sweep::stale_temp_files(&paths, None);
    let exec = args.executor(lib.clone(), paths.clone())?;
    let (sink, progress) = event_sink(&args)?;

    let file = std::path::absolute(&args.file)
        .with_context(|| format!("cannot resolve {}", args.file.display()))?;
    let dir = file
        .parent()
        .map(PathBuf::from)
        .context("the workflow file has no parent folder")?;
    let name = file
        .file_name()
        .map(|n| n.to_os_string())
        .context("the workflow path has no file name")?;

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let target = name.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            if ev.kind.is_access() {
                return;
            }
            if ev
                .paths
                .iter()
                .any(|p| p.file_name() == Some(target.as_os_str()))
            {
                let _ = tx.send(());
            }
        }
    })
    .context("cannot start the file watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("cannot watch {}", dir.display()))?;

    loop {
        match load_and_validate(&args.file, &args.set, &lib, &paths) {
            Ok(Loaded::Ok(graph)) => {
                print_diagnostics(&args.file, &graph.warnings);
                run_graph(&exec, &graph, sink.clone(), CancelToken::new()).await;
                if args.free_after_run {
                    exec.clear_cache();
                    exec.runtime().free();
                }
            }
            Ok(Loaded::Invalid(d)) => print_diagnostics(&args.file, &d),
            Err(e) => eprintln!("error: {e:#}"),
        }
        if let Some(p) = &progress {
            p.finish();
        }
        eprintln!("watching {} (Ctrl-C to quit)", args.file.display());
        // Wait for a change, then for the burst of events to settle.
        tokio::select! {
            got = rx.recv() => {
                if got.is_none() {
                    return Ok(0);
                }
            }
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(DEBOUNCE) => break,
                got = rx.recv() => if got.is_none() { break },
            }
        }
        eprintln!("{} changed: re-running", args.file.display());
    }
}
