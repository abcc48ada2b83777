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
