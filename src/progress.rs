//! Terminal progress: one line per node, a bar for nodes that report steps.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sdkit_engine::Event;
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub struct Progress {
    bar: Arc<Mutex<Option<ProgressBar>>>,
}

impl Progress {
    pub fn new() -> Self {
        Progress {
            bar: Arc::new(Mutex::new(None)),
        }
    }

    fn with_bar(&self, f: impl FnOnce(&mut Option<ProgressBar>)) {
        let mut g = self
            .bar
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut g);
    }

    pub fn event(&self, e: &Event) {
        match e {
            Event::ExecutionCached { nodes, .. } if !nodes.is_empty() => {
                eprintln!("cached: {}", nodes.join(", "));
            }
            Event::Executing {
                node: Some(node), ..
            } => {
                self.with_bar(|b| {
                    if let Some(old) = b.take() {
                        old.finish_and_clear();
                    }
                });
                eprintln!("executing {node}");
            }
            Event::Progress {
                value, max, node, ..
            } => self.with_bar(|b| {
                let bar = b.get_or_insert_with(|| {
                    let pb =
                        ProgressBar::with_draw_target(Some(*max), ProgressDrawTarget::stderr());
                    pb.set_style(
                        ProgressStyle::with_template(
                            "{msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}",
                        )
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    pb.set_message(format!("node {node}"));
                    pb
                });
                bar.set_length(*max);
                bar.set_position(*value);
            }),
            Event::ExecutionError {
                node_id,
                node_type,
                exception_message,
                ..
            } => {
                self.finish();
                eprintln!("node {node_id} ({node_type}) failed: {exception_message}");
            }
            Event::ExecutionSuccess { .. } | Event::ExecutionInterrupted { .. } => self.finish(),
            _ => {}
        }
    }

    pub fn finish(&self) {
        self.with_bar(|b| {
            if let Some(old) = b.take() {
                old.finish_and_clear();
            }
        });
    }
}
