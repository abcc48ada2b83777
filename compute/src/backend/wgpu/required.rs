//! What a test does where no wgpu adapter opens: skip, saying so, on a
//! developer's machine without Vulkan; fail where the run demands the
//! backend (`.ci/run` sets `SDKIT_REQUIRE_WGPU=1` and installs lavapipe),
//! so a broken driver setup in CI is a failure, not a quiet pass.

use std::fmt::Display;

/// The variable that makes a missing adapter a failure.
pub const REQUIRE_VAR: &str = "SDKIT_REQUIRE_WGPU";

/// Reports that `what` cannot run because no adapter opened (`why`):
/// panics when [`REQUIRE_VAR`] is set, else prints "skipped" and returns,
/// for the caller to return too. Features an adapter lacks (cooperative
/// matrices, pipeline caches) are not this: those cases skip everywhere.
pub fn no_adapter(what: &str, why: impl Display) {
    if std::env::var_os(REQUIRE_VAR).is_some() {
        panic!("{what}: no wgpu adapter ({why}), and {REQUIRE_VAR} demands one");
    }
    eprintln!("skipped: {what}: no wgpu adapter ({why})");
}
