//! Execution events, named and shaped as ComfyUI's WebSocket messages so the
//! server can forward them unchanged.

use serde::Serialize;
use serde_json::Value as Json;
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
pub enum Event {
    ExecutionStart {
        prompt_id: String,
        timestamp: u64,
    },
    ExecutionCached {
        nodes: Vec<String>,
        prompt_id: String,
        timestamp: u64,
    },
    /// `node: None` marks the end of a run (after its success, error or
    /// interruption message), as in ComfyUI.
    Executing {
        node: Option<String>,
        display_node: Option<String>,
        prompt_id: String,
    },
    Progress {
        value: u64,
        max: u64,
        prompt_id: String,
        node: String,
    },
    Executed {
        node: String,
        display_node: String,
        output: Json,
        prompt_id: String,
    },
    ExecutionError {
        prompt_id: String,
        node_id: String,
        node_type: String,
        executed: Vec<String>,
        exception_message: String,
        exception_type: String,
        traceback: Vec<String>,
        current_inputs: Json,
        current_outputs: Json,
        timestamp: u64,
    },
    ExecutionInterrupted {
        prompt_id: String,
        node_id: String,
        node_type: String,
        executed: Vec<String>,
        timestamp: u64,
    },
    ExecutionSuccess {
        prompt_id: String,
        timestamp: u64,
    },
    /// sdkit's own (ComfyUI clients ignore unknown types): how a node's
    /// model use placed its weights under the device memory budget, with
    /// the planner's numbers and the bytes actually uploaded.
    #[serde(rename = "sdkit_residency")]
    Residency {
        prompt_id: String,
        node: String,
        model: String,
        budget: u64,
        weight_bytes: u64,
        resident_bytes: u64,
        streamed_bytes_per_run: u64,
        lower_bound_per_run: u64,
        runs: u64,
        /// The use's activations (arena, inputs, outputs) on the device.
        activation_bytes: u64,
        /// Weight bytes the plan copies to stay (not already resident).
        loaded_bytes: u64,
        /// Bytes actually copied: `loaded_bytes` + runs × streamed.
        uploaded_bytes: u64,
        /// Other models' weights dropped from the device to make room.
        evicted_bytes: u64,
        /// The most device memory in use during the use: its plan plus the
        /// weights other models keep (≤ budget).
        device_bytes: u64,
        /// Times the device ran out of memory and the use was re-planned
        /// with half the room for weights (`budget` is the one it ran
        /// under).
        out_of_memory_replans: u32,
    },
    /// The run's model uses in the order they will run (nodes that run a
    /// model on the device; models named by their source's cache key).
    #[serde(rename = "sdkit_schedule")]
    Schedule {
        prompt_id: String,
        uses: Vec<sdkit_compute::plan::schedule::ScheduledUse>,
    },
    /// A sampler's view of its current result each step (ComfyUI's latent
    /// preview). The server sends it as a binary preview frame; as JSON it
    /// carries only its size.
    #[serde(rename = "sdkit_preview")]
    Preview {
        prompt_id: String,
        node: String,
        image: PreviewImage,
    },
}

/// How samplers preview their progress (ComfyUI's `--preview-method`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PreviewMethod {
    /// The latent format's linear RGB factors (cheap; ComfyUI's default).
    #[default]
    Latent2Rgb,
    /// The family's TAESD decoder from `models/vae_approx`, falling back
    /// to latent2rgb when it is missing.
    Taesd,
    /// No previews.
    None,
}

/// An 8-bit RGB image, rows top to bottom.
#[derive(Clone, Debug, PartialEq)]
pub struct PreviewImage {
    pub width: u32,
    pub height: u32,
    pub rgb: Arc<Vec<u8>>,
}

impl Serialize for PreviewImage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("PreviewImage", 2)?;
        st.serialize_field("width", &self.width)?;
        st.serialize_field("height", &self.height)?;
        st.end()
    }
}

impl Event {
    /// ComfyUI's message type name.
    pub fn name(&self) -> &'static str {
        match self {
            Event::ExecutionStart { .. } => "execution_start",
            Event::ExecutionCached { .. } => "execution_cached",
            Event::Executing { .. } => "executing",
            Event::Progress { .. } => "progress",
            Event::Executed { .. } => "executed",
            Event::ExecutionError { .. } => "execution_error",
            Event::ExecutionInterrupted { .. } => "execution_interrupted",
            Event::ExecutionSuccess { .. } => "execution_success",
            Event::Residency { .. } => "sdkit_residency",
            Event::Schedule { .. } => "sdkit_schedule",
            Event::Preview { .. } => "sdkit_preview",
        }
    }
}

/// Where events go: a progress bar, a JSON-lines file, a WebSocket.
pub type EventSink = Arc<dyn Fn(&Event) + Send + Sync>;

/// A sink that drops everything.
pub fn discard() -> EventSink {
    Arc::new(|_| {})
}

/// Milliseconds since the Unix epoch, as ComfyUI stamps its messages.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
