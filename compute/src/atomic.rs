//! Atomic file writes, and removing what writers that died left behind.
//!
//! Every temporary file sdkit writes is named `.sdkit-{pid}-{n}-{tag}.tmp`
//! beside its destination (the writer's process id, a per-process counter,
//! a short description) and renamed over the destination once complete.
//! A process killed mid-write (kill -9, power loss) cannot remove its
//! temporaries, so the CLI and the server [`sweep`] their folders at start:
//! the pid in the name tells whether the writer is still alive, which is
//! what makes a sweep safe while other sdkit processes share the folders.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// What every temporary name starts with.
pub const PREFIX: &str = ".sdkit-";
/// What every temporary name ends with.
pub const SUFFIX: &str = ".tmp";

/// Where the writer's liveness cannot be checked (no `/proc`), a temporary
/// file untouched for this long is taken as abandoned: no write of sdkit's
/// takes an hour between two writes to its file.
pub const ABANDONED_AFTER: Duration = Duration::from_secs(3600);

/// The longest `tag` kept in a name, so that a name stays far below
/// NAME_MAX (255 bytes) whatever the caller derives it from.
const MAX_TAG: usize = 64;

/// Folder levels below each root a sweep looks into.
const MAX_DEPTH: usize = 8;
/// Directory entries a sweep looks at in all, so that start-up stays fast
/// on an output folder of millions of images.
const MAX_ENTRIES: usize = 200_000;

/// A fresh temporary path in `dir` for this process. `tag` says what is
/// being written (e.g. the destination's name); characters other than
/// ASCII letters, digits, `.`, `_` and `-` become `_`, and it is cut to 64
/// bytes.
pub fn temp_path(dir: &Path, tag: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tag: String = tag
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(MAX_TAG)
        .collect();
    dir.join(format!("{PREFIX}{}-{n}-{tag}{SUFFIX}", std::process::id()))
}

/// The writer's pid in a temporary file's name: `Some(Some(pid))` for a
/// name [`temp_path`] made, `Some(None)` for an older sdkit's name without
/// a pid (`.sdkit-weights-XXXXXX.tmp`), `None` for any other file.
pub fn writer_pid(name: &str) -> Option<Option<u32>> {
    let rest = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    let digits = rest.split('-').next().unwrap_or("");
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Some(digits.parse().ok());
    }
    // Names an earlier version wrote through the tempfile crate.
    rest.starts_with("weights-").then_some(None)
}

/// A temporary file beside its destination, removed when dropped unless
/// [`TempFile::persist`] renamed it into place.
pub struct TempFile {
    path: PathBuf,
    file: Option<File>,
}

impl TempFile {
    /// Creates a temporary file in the folder of `dest`.
    pub fn beside(dest: &Path) -> io::Result<TempFile> {
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let tag = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let path = temp_path(dir, &tag);
        let file = File::create_new(&path)?;
        Ok(TempFile {
            path,
            file: Some(file),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file, to write into.
    pub fn file(&mut self) -> io::Result<&mut File> {
        // Only `persist` takes the file out, and it consumes `self`.
        self.file
            .as_mut()
            .ok_or_else(|| io::Error::other("the temporary file is closed"))
    }

    /// Flushes the file to disk and renames it over `dest`.
    pub fn persist(mut self, dest: &Path) -> io::Result<()> {
        // Closed before the rename, which Windows refuses on an open file.
        if let Some(f) = self.file.take() {
            f.sync_all()?;
        }
        std::fs::rename(&self.path, dest)?;
        // Renamed: nothing is left for `drop` to remove.
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        drop(self.file.take());
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes `data` to `path` atomically: a reader sees the old file or the
/// new one, never half of one, and a failed write leaves the old file.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut tmp = TempFile::beside(path)?;
    tmp.file()?.write_all(data)?;
    tmp.persist(path)
}

/// Removes the temporary files of writers that are gone from the folders
/// under `roots` (recursively, at most 8 levels and 200,000 entries, never
/// through symbolic links). Only names [`writer_pid`] recognises are
/// touched. Returns the files removed.
pub fn sweep(roots: &[&Path]) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let mut budget = MAX_ENTRIES;
    let mut seen: Vec<PathBuf> = Vec::new();
    for root in roots {
        // The same folder can be given twice (e.g. input = output).
        let key = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let mut stack = vec![(root.to_path_buf(), 0usize)];
        while let Some((dir, depth)) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if budget == 0 {
                    return removed;
                }
                budget -= 1;
                // `file_type` does not follow symbolic links.
                let Ok(ty) = entry.file_type() else { continue };
                if ty.is_dir() {
                    if depth < MAX_DEPTH {
                        stack.push((entry.path(), depth + 1));
                    }
                    continue;
                }
                if !ty.is_file() {
                    continue;
                }
                let name = entry.file_name();
                let Some(pid) = name.to_str().and_then(writer_pid) else {
                    continue;
                };
                let modified = entry.metadata().and_then(|m| m.modified()).ok();
                if is_abandoned(pid, modified) && std::fs::remove_file(entry.path()).is_ok() {
                    removed.push(entry.path());
                }
            }
        }
    }
    removed
}

/// Whether a temporary file written by `pid` (None: unknown) and last
/// modified at `modified` belongs to no live writer.
fn is_abandoned(pid: Option<u32>, modified: Option<SystemTime>) -> bool {
    let old = || {
        modified
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age > ABANDONED_AFTER)
    };
    let Some(pid) = pid else { return old() };
    if pid == std::process::id() {
        return false;
    }
    if !Path::new("/proc/self").exists() {
        return old();
    }
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return true;
    }
    // The pid is alive, but pids are reused: a process that started well
    // after the file was last written cannot be its writer.
    match (process_start(pid), modified) {
        (Some(start), Some(m)) => start > m + Duration::from_secs(60),
        _ => false,
    }
}

/// When process `pid` started, from `/proc` (Linux).
fn process_start(pid: u32) -> Option<SystemTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses; the
    // fields after its last `)` start at field 3, so field 22 (start time,
    // in clock ticks after boot) is the 20th.
    let after = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // /proc reports ticks in USER_HZ, which is 100 on every architecture
    // Linux exposes to user space this way.
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(boot) + Duration::from_millis(ticks * 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_pid_and_stay_short() {
        let p = temp_path(Path::new("/x"), &"a/b c".repeat(100));
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        assert!(name.len() < 100, "{name}");
        assert_eq!(writer_pid(name), Some(Some(std::process::id())));
        assert!(!name.contains('/') && !name.contains(' '));
    }

    #[test]
    fn only_sdkit_names_are_recognised() {
        assert_eq!(writer_pid(".sdkit-12-0-x.png.tmp"), Some(Some(12)));
        // No pid: an earlier version's weights file, or a pid past u32.
        assert_eq!(writer_pid(".sdkit-weights-Ab12.tmp"), Some(None));
        assert_eq!(writer_pid(".sdkit-99999999999-1.tmp"), Some(None));
        for other in [
            "sdkit-12-0-x.tmp",
            ".sdkit-12-0-x.png",
            ".sdkit--x.tmp",
            ".sdkit-x-1.tmp",
            ".comfy.settings.json.12.0.tmp",
            "photo.png",
        ] {
            assert_eq!(writer_pid(other), None, "{other}");
        }
    }

    #[test]
    fn a_dropped_temp_file_is_removed_and_a_persisted_one_renamed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("a.json");
        let mut t = TempFile::beside(&dest).expect("create");
        let tmp = t.path().to_path_buf();
        t.file().and_then(|f| f.write_all(b"x")).expect("write");
        drop(t);
        assert!(!tmp.exists());
        write_atomic(&dest, b"y").expect("write");
        assert_eq!(std::fs::read(&dest).expect("read"), b"y");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }
}
