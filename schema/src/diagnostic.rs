//! Diagnostics: every problem found in a workflow, with where it is.

use crate::syntax::Pos;
use serde::Serialize;
use std::borrow::Cow;
use std::fmt;

/// The most of a user's value (in characters) a message echoes.
pub const ECHO_CHARS: usize = 200;

/// A message longer than this (in bytes) is cut in the middle: it echoes
/// a value too long to read (a 120 KB `--set` value, a 20 MB string in a
/// workflow), and the reader needs its start and the message's end.
const MESSAGE_MAX: usize = 2000;

/// `value` as a message echoes it: whole when short, else its first 200
/// characters and its size.
pub fn echo(value: &str) -> Cow<'_, str> {
    match value.char_indices().nth(ECHO_CHARS) {
        None => Cow::Borrowed(value),
        Some((cut, _)) => Cow::Owned(format!("{}… ({} bytes)", &value[..cut], value.len())),
    }
}

/// `message`, cut in the middle when longer than [`MESSAGE_MAX`] bytes.
pub fn cap_message(message: String) -> String {
    if message.len() <= MESSAGE_MAX {
        return message;
    }
    let head = message
        .char_indices()
        .nth(ECHO_CHARS)
        .map_or(message.len(), |(i, _)| i);
    let tail = message
        .char_indices()
        .rev()
        .nth(ECHO_CHARS / 2 - 1)
        .map_or(head, |(i, _)| i.max(head));
    format!(
        "{}… ({} bytes) …{}",
        &message[..head],
        message.len(),
        &message[tail..]
    )
}

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

impl Diagnostic {
    pub fn error(kind: DiagKind, message: impl Into<String>) -> Self {
        Diagnostic {
            kind,
            severity: Severity::Error,
            message: cap_message(message.into()),
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
mod echo_tests {
    use super::*;

    #[test]
    fn long_values_and_messages_are_cut_on_character_boundaries() {
        assert_eq!(echo("short"), "short");
        let long = "é".repeat(5000);
        let e = echo(&long);
        assert!(e.starts_with(&"é".repeat(ECHO_CHARS)) && e.ends_with("… (10000 bytes)"));
        let d = Diagnostic::error(DiagKind::InvalidInputType, format!("\"{long}\" is no int"));
        assert!(d.message.len() < 1000, "{}", d.message);
        assert!(d.message.ends_with("é\" is no int") && d.message.contains("(10012 bytes)"));
    }
}
