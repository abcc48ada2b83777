pub mod cpu;
pub mod wgpu;

/// Errors binding a Program's named weights and inputs, shared by every
/// backend.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("input \"{0}\" is not bound")]
    MissingInput(String),
    #[error("weight \"{0}\" is not bound")]
    MissingWeight(String),
    #[error("\"{name}\" has {got} values, the program expects {want}")]
    WrongSize {
        name: String,
        got: usize,
        want: usize,
    },
}

impl BindError {
    /// Checks a bound tensor's element count against the Program's buffer.
    pub fn check_len(name: &str, got: usize, want: usize) -> Result<(), BindError> {
        if got == want {
            Ok(())
        } else {
            Err(BindError::WrongSize {
                name: name.to_string(),
                got,
                want,
            })
        }
    }
}

/// `SDKIT_PROFILE=1`: each backend times every kernel of a run and prints
/// the time per kernel kind to stderr after it (`SDKIT_PROFILE_KERNELS=1`
/// adds a line per kernel). On the wgpu backend each kernel is then its
/// own submission, waited for: slower, but the time is the kernel's.
pub(crate) struct KernelTimes {
    kinds: Vec<(&'static str, f64, usize)>,
    each: bool,
}

impl KernelTimes {
    /// A collector when `SDKIT_PROFILE` is set, else None.
    pub(crate) fn from_env() -> Option<Self> {
        std::env::var_os("SDKIT_PROFILE").map(|_| KernelTimes {
            kinds: Vec::new(),
            each: std::env::var_os("SDKIT_PROFILE_KERNELS").is_some(),
        })
    }

    /// Adds kernel `k` of `prog` that took `secs`.
    pub(crate) fn add(&mut self, prog: &crate::plan::Program, k: crate::plan::KernelId, secs: f64) {
        let kernel = &prog.kernels[k.0 as usize];
        // A fused elementwise chain reads better as one kind.
        let name = if kernel.epilogue.is_some()
            && matches!(kernel.kind, crate::plan::KernelKind::Elementwise)
        {
            "elementwise"
        } else {
            kernel.kind.name()
        };
        if self.each {
            eprintln!(
                "profile: k{} {name} {:?} {:.3} ms {:?}",
                k.0,
                kernel.output.shape,
                secs * 1e3,
                kernel.epilogue
            );
        }
        self.add_other(name, secs, 1);
    }

    /// Adds `secs` spent on `name` outside kernels (`dispatches` of them).
    pub(crate) fn add_other(&mut self, name: &'static str, secs: f64, dispatches: usize) {
        match self.kinds.iter_mut().find(|e| e.0 == name) {
            Some(e) => {
                e.1 += secs;
                e.2 += dispatches;
            }
            None => self.kinds.push((name, secs, dispatches)),
        }
    }

    /// Prints the kinds, costliest first.
    pub(crate) fn print(mut self) {
        self.kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (name, secs, n) in &self.kinds {
            eprintln!(
                "profile: {name:<12} {:9.3} ms in {n} dispatches",
                secs * 1e3
            );
        }
    }
}
