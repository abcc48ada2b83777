//! Host memory: fallible allocation of node outputs, and the check of a
//! node's estimated allocation against what the process can still get.
//!
//! A workflow's sizes come from the user, so an allocation that does not
//! fit must become a node error: Rust's default on allocation failure is to
//! abort the process, which would take a server and every other prompt in
//! its queue down with it.

use crate::node::{Inputs, NodeContext, NodeError, NodeImpl};

/// `n` copies of `value`, or an error when the memory is not there.
pub fn try_filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>, AllocError> {
    let mut v = try_with_capacity(n)?;
    v.resize(n, value);
    Ok(v)
}

/// An empty vector with room for `n` elements, or an error when the
/// memory is not there.
pub fn try_with_capacity<T>(n: usize) -> Result<Vec<T>, AllocError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| AllocError {
        bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
    })?;
    Ok(v)
}

/// An allocation that failed: how many bytes it asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocError {
    pub bytes: u64,
}

impl AllocError {
    /// The node error for a tensor of `shape` described as `kind` ("latent",
    /// "image", ...).
    pub fn for_tensor(self, kind: &str, shape: &[usize]) -> NodeError {
        NodeError::OutOfMemory {
            what: describe(kind, shape),
            bytes: self.bytes,
            available: None,
        }
    }
}

/// "a 64×4×2048×2048 latent".
pub fn describe(kind: &str, shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("a {} {kind}", dims.join("×"))
}

/// Bytes of `shape` f32 values, saturating (a shape whose size overflows is
/// as unallocatable as the largest size).
pub fn f32_bytes(shape: &[usize]) -> u64 {
    shape.iter().fold(4u64, |n, &d| n.saturating_mul(d as u64))
}

/// Bytes for people: "4.0 GiB", "512 B".
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Refuses a node whose estimated host allocation exceeds the memory the
/// process can still get, before it runs: a clear error at once instead of
/// minutes of swapping, an abort, or the kernel's OOM killer. Nodes without
/// an estimate, and hosts where the available memory is unknown, pass.
pub fn admit(imp: &dyn NodeImpl, ctx: &NodeContext, inputs: &Inputs) -> Result<(), NodeError> {
    let Some(need) = imp.estimate_bytes(ctx, inputs) else {
        return Ok(());
    };
    match available_bytes() {
        Some(free) if need > free => Err(NodeError::OutOfMemory {
            what: "what this node would allocate".into(),
            bytes: need,
            available: Some(free),
        }),
        _ => Ok(()),
    }
}

/// The memory this process can still allocate: the least of the system's
/// available memory (RAM plus free swap), what the address-space limit
/// (`ulimit -v`, `prlimit --as`) leaves and what the cgroup limit leaves.
/// `None` where none of them can be read (not Linux).
pub fn available_bytes() -> Option<u64> {
    [system_available(), address_space_left(), cgroup_left()]
        .into_iter()
        .flatten()
        .min()
}

/// A `Name:   123 kB` field of a /proc file, in bytes.
fn proc_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let rest = line[name.len()..].trim_start_matches(':').trim();
    let mut parts = rest.split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    Some(match parts.next() {
        Some("kB") => n.saturating_mul(1024),
        _ => n,
    })
}

fn system_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let avail = proc_field(&info, "MemAvailable")?;
    Some(avail.saturating_add(proc_field(&info, "SwapFree").unwrap_or(0)))
}

/// RLIMIT_AS minus the address space already mapped.
fn address_space_left() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    // Columns: name, soft limit, hard limit, units; the soft limit applies.
    let soft = line["Max address space".len()..]
        .split_whitespace()
        .next()?;
    let limit: u64 = soft.parse().ok()?; // "unlimited" → no limit
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let used = proc_field(&status, "VmSize")?;
    Some(limit.saturating_sub(used))
}

/// cgroup v2 `memory.max` minus what the group uses that it cannot drop
/// (`memory.current` less its inactive file cache).
fn cgroup_left() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max" → no limit
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    let inactive = read("memory.stat")
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("inactive_file ")?.trim().parse().ok())
        })
        .unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(inactive)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_allocations_fail_into_errors() {
        // Over isize::MAX bytes: refused before asking the allocator.
        let e = try_filled(usize::MAX / 8, 0f32).expect_err("cannot fit");
        assert_eq!(e.bytes, (usize::MAX / 8) as u64 * 4);
        // 64 TiB: the allocator says no (Linux's default overcommit
        // heuristic refuses a mapping larger than RAM and swap), and that
        // must be an error, not an abort. Nothing is touched, so where
        // overcommit is unlimited and the mapping succeeds it costs nothing.
        let unlimited = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
            .is_ok_and(|s| s.trim() == "1");
        let r = try_with_capacity::<f32>(1 << 44);
        if !unlimited && cfg!(target_os = "linux") {
            assert_eq!(r.map(|v| v.capacity()), Err(AllocError { bytes: 1 << 46 }));
        }
        let msg = AllocError { bytes: 1 << 32 }
            .for_tensor("latent", &[64, 4, 2048, 2048])
            .to_string();
        assert_eq!(
            msg,
            "not enough memory for a 64×4×2048×2048 latent (4.0 GiB)"
        );
        assert_eq!(try_filled(3, 1u8).expect("small"), vec![1, 1, 1]);
    }

    #[test]
    fn sizes_read_for_people() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(4 << 30), "4.0 GiB");
        assert_eq!(f32_bytes(&[64, 4, 2048, 2048]), 4 << 30);
        assert_eq!(f32_bytes(&[usize::MAX, 2]), u64::MAX);
    }

    #[test]
    fn proc_fields_parse() {
        let t = "MemTotal:       16000 kB\nMemAvailable:    8000 kB\n";
        assert_eq!(proc_field(t, "MemAvailable"), Some(8000 * 1024));
        assert_eq!(proc_field(t, "SwapFree"), None);
        if cfg!(target_os = "linux") {
            assert!(available_bytes().is_some_and(|b| b > 0));
        }
    }
}
