//! Diagnostics: every problem found in a workflow, with where it is.

use crate::syntax::Pos;
use serde::Serialize;
use std::fmt;

/// The kind of a problem, spelled as ComfyUI spells its validation error
/// types where ComfyUI has one, so API clients can match on them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiagKind {
    /// The file is not valid JSON/RON.
    SyntaxError,
    /// The document is not a workflow, or a node lacks its type.
    InvalidPrompt,
    /// A node's type is not registered.
    MissingNodeType,
    RequiredInputMissing,
    /// An input the node type does not declare.
    UnknownInput,
    /// A link to a missing node or output.
    BadLinkedInput,
    ReturnTypeMismatch,
    InvalidInputType,
    ValueSmallerThanMin,
    ValueBiggerThanMax,
    ValueNotInList,
    CustomValidationFailed,
    PromptNoOutputs,
    DependencyCycle,
    /// A registered node type sdkit cannot run yet.
    NotImplemented,
}

impl DiagKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DiagKind::SyntaxError => "syntax_error",
            DiagKind::InvalidPrompt => "invalid_prompt",
            DiagKind::MissingNodeType => "missing_node_type",
            DiagKind::RequiredInputMissing => "required_input_missing",
            DiagKind::UnknownInput => "unknown_input",
            DiagKind::BadLinkedInput => "bad_linked_input",
            DiagKind::ReturnTypeMismatch => "return_type_mismatch",
            DiagKind::InvalidInputType => "invalid_input_type",
            DiagKind::ValueSmallerThanMin => "value_smaller_than_min",
            DiagKind::ValueBiggerThanMax => "value_bigger_than_max",
            DiagKind::ValueNotInList => "value_not_in_list",
            DiagKind::CustomValidationFailed => "custom_validation_failed",
            DiagKind::PromptNoOutputs => "prompt_no_outputs",
            DiagKind::DependencyCycle => "dependency_cycle",
            DiagKind::NotImplemented => "node_not_implemented",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    /// Reported, but the workflow still runs (e.g. an input this engine
    /// does not know in a ComfyUI workflow from a newer ComfyUI).
    Warning,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diagnostic {
    #[serde(rename = "type")]
    pub kind: DiagKind,
    pub severity: Severity,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<u32>,
}

/// The most characters of a message that are kept (see [`shorten`]).
pub const MAX_MESSAGE: usize = 2000;

/// `s`, or its first `max` characters followed by "… (N bytes in all)":
/// a message that echoes a user's value must not echo megabytes of it.
pub fn shorten(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => std::borrow::Cow::Borrowed(s),
        Some((cut, _)) => format!("{}… ({} bytes in all)", &s[..cut], s.len()).into(),
    }
}

impl Diagnostic {
    pub fn error(kind: DiagKind, message: impl Into<String>) -> Self {
        let message = message.into();
        let message = match shorten(&message, MAX_MESSAGE) {
            std::borrow::Cow::Borrowed(_) => message,
            std::borrow::Cow::Owned(s) => s,
        };
        Diagnostic {
            kind,
            severity: Severity::Error,
            message,
            node_id: None,
            node_type: None,
            input: None,
            line: None,
            column: None,
        }
    }

    pub fn warning(kind: DiagKind, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(kind, message)
        }
    }

    pub fn node(mut self, id: &str, ty: &str) -> Self {
        self.node_id = Some(id.to_string());
        if !ty.is_empty() {
            self.node_type = Some(ty.to_string());
        }
        self
    }

    pub fn input(mut self, name: &str) -> Self {
        self.input = Some(name.to_string());
        self
    }

    /// Attaches a file position; the default (0:0) position of workflows
    /// that did not come from a file is ignored.
    pub fn at(mut self, pos: Option<Pos>) -> Self {
        if let Some(p) = pos.filter(|p| p.line > 0) {
            self.line = Some(p.line);
            self.column = Some(p.col);
        }
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let (Some(l), Some(c)) = (self.line, self.column) {
            write!(f, "{l}:{c}: ")?;
        }
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(f, "{sev}[{}]", self.kind.as_str())?;
        if let Some(id) = &self.node_id {
            write!(f, " node \"{id}\"")?;
            if let Some(t) = &self.node_type {
                write!(f, " ({t})")?;
            }
        }
        if let Some(i) = &self.input {
            write!(f, " input \"{i}\"")?;
        }
        write!(f, ": {}", self.message)
    }
}

#[cfg(test)]
mod shorten_tests {
    use super::*;

    #[test]
    fn long_values_are_cut_on_a_char_boundary_and_say_their_size() {
        assert_eq!(shorten("short", 10), "short");
        let long = "é".repeat(5000);
        let s = shorten(&long, 3);
        assert_eq!(s, "ééé… (10000 bytes in all)");
        let d = Diagnostic::error(DiagKind::InvalidPrompt, "x".repeat(20 << 20));
        assert!(d.message.len() < MAX_MESSAGE + 64, "{}", d.message.len());
    }
}
