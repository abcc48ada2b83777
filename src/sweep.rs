//! At start, removes the temporary files that sdkit processes killed
//! mid-write left behind (see `sdkit_compute::atomic`): in the folders runs
//! write to, the user data folder and the kernel cache folder. Files of
//! writers still alive, and every other file, are left alone.

use sdkit_engine::Paths;
use std::path::Path;

/// Sweeps the folders of `paths` (and `user_dir`, the server's), telling
/// on stderr what was removed.
pub fn stale_temp_files(paths: &Paths, user_dir: Option<&Path>) {
    let cache = sdkit_compute::backend::wgpu::default_cache_dir();
    let mut roots: Vec<&Path> = vec![&paths.output, &paths.temp, &paths.input];
    roots.extend(user_dir);
    roots.extend(cache.as_deref());
    let removed = sdkit_compute::atomic::sweep(&roots);
    if let Some(first) = removed.first() {
        eprintln!(
            "note: removed {} temporary file{} left by an sdkit process that was killed mid-write (e.g. {})",
            removed.len(),
            if removed.len() == 1 { "" } else { "s" },
            first.display()
        );
    }
}
