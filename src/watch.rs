//! `sdkit watch`: run, then re-validate and re-run on every save.
//!
//! The parent folder is watched rather than the file, because editors often
//! save by writing a temporary file and renaming it over the original, which
//! replaces the inode a file watch would follow. When the path is a
//! symbolic link (or a chain of them), the folder of every link and of the
//! file at the end is watched too, since an edit of the target changes
//! nothing in the link's folder; the chain is followed again after each
//! change, as a link can be pointed elsewhere. The executor (and its cache)
//! lives across runs, so a re-run executes only changed nodes.

use crate::cli::{
    event_sink, load_and_validate, print_diagnostics, print_graph_diagnostics, run_graph, Loaded,
    RunArgs,
};
use anyhow::{Context, Result};
use notify::{RecursiveMode, Watcher};
use sdkit_engine::CancelToken;
use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
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
    let watched: Arc<Mutex<Watched>> = Arc::default();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let seen = Arc::clone(&watched);
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            if ev.kind.is_access() {
                return;
            }
            let w = seen.lock().unwrap_or_else(PoisonError::into_inner);
            if ev.paths.iter().any(|p| w.concerns(p)) {
                let _ = tx.send(());
            }
        }
    })
    .context("cannot start the file watcher")?;
    // The folder of the path as given must be watchable; folders further
    // along a chain of links are watched where they exist.
    let dir = file
        .parent()
        .context("the workflow file has no parent folder")?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("cannot watch {}", dir.display()))?;
    watched
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .dirs
        .insert(std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()));
    follow_links(&file, &watched, &mut watcher);

    loop {
        match load_and_validate(&args.file, &args.set, &lib, &paths, args.outputs()) {
            Ok(Loaded::Ok(graph)) => {
                print_graph_diagnostics(&args.file, &graph);
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
        // A link in the chain may now point elsewhere.
        follow_links(&file, &watched, &mut watcher);
    }
}

/// Symbolic links followed at most, as the kernel does (ELOOP).
const MAX_LINKS: usize = 40;

/// The files whose change is a change of the workflow, each as its folder
/// (canonical, so that paths an event reports through another spelling of
/// the folder still match) and name; and the folders being watched.
#[derive(Default)]
struct Watched {
    files: Vec<(PathBuf, OsString)>,
    dirs: HashSet<PathBuf>,
}

impl Watched {
    fn concerns(&self, path: &Path) -> bool {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return false;
        };
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        self.files.iter().any(|(d, n)| *d == dir && n == name)
    }
}

/// The path given, every link it leads through, and the path at the end
/// (a cycle or a missing link ends the chain).
fn link_chain(file: &Path) -> Vec<PathBuf> {
    let mut chain = vec![file.to_path_buf()];
    let mut cur = file.to_path_buf();
    for _ in 0..MAX_LINKS {
        let Ok(target) = std::fs::read_link(&cur) else {
            break;
        };
        // A relative target is relative to the link's folder; `join` keeps
        // an absolute one as it is.
        let next = cur.parent().map_or(target.clone(), |d| d.join(&target));
        if chain.contains(&next) {
            break;
        }
        chain.push(next.clone());
        cur = next;
    }
    // Links in the folders along the way resolve here.
    if let Ok(real) = std::fs::canonicalize(file) {
        if !chain.contains(&real) {
            chain.push(real);
        }
    }
    chain
}

/// Resolves `file`'s chain of links again and watches the folders not yet
/// watched.
fn follow_links(file: &Path, watched: &Mutex<Watched>, watcher: &mut impl Watcher) {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for p in link_chain(file) {
        let (Some(dir), Some(name)) = (p.parent(), p.file_name()) else {
            continue;
        };
        let canon = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        files.push((canon.clone(), name.to_os_string()));
        dirs.push((canon, dir.to_path_buf()));
    }
    let new_dirs: Vec<_> = {
        let mut w = watched.lock().unwrap_or_else(PoisonError::into_inner);
        w.files = files;
        dirs.into_iter()
            .filter(|(canon, _)| !w.dirs.contains(canon))
            .collect()
    };
    // Not under the lock: the watcher's thread may be waiting for it in
    // the event callback while `watch` waits for that thread.
    for (canon, dir) in new_dirs {
        match watcher.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                watched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .dirs
                    .insert(canon);
            }
            Err(e) => eprintln!("warning: cannot watch {}: {e}", dir.display()),
        }
    }
}
