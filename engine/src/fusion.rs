//! Cross-node fusion: on a GPU, a node that makes an image in a program
//! (VAEDecode) takes the pure image operations after it (invert, scale,
//! crop, …) into that program, so the image reaches the host once, in its
//! final form. A chain stops at a node whose output is read twice, by an
//! output node, or whose inputs or mode have no tensor form; such nodes
//! run as usual on the host.

use crate::graph::{Graph, GraphInput};
use crate::node::{ImageStage, Inputs, NodeContext, NodeError, NodeImpl, NodeLibrary, NodeOutput};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// One node after a producer: its index, stage, implementation, context
/// and constant inputs (for running it on the host when the producer
/// declines the tail).
pub(crate) struct Member {
    pub index: usize,
    pub stage: ImageStage,
    pub imp: Arc<dyn NodeImpl>,
    pub consts: HashMap<String, crate::value::Value>,
    pub ctx: Option<NodeContext>,
}

/// The chains among `to_run`, by producer.
pub(crate) fn image_chains(
    library: &NodeLibrary,
    graph: &Graph,
    to_run: &HashSet<usize>,
) -> HashMap<usize, Vec<Member>> {
    // Who reads each node's outputs, among the nodes to run.
    let mut readers: HashMap<usize, Vec<(usize, &str, usize)>> = HashMap::new();
    for &j in to_run {
        for (name, inp) in &graph.nodes[j].inputs {
            if let GraphInput::Link { node, output } = inp {
                readers
                    .entry(*node)
                    .or_default()
                    .push((j, name.as_str(), *output));
            }
        }
    }
    let mut chains = HashMap::new();
    for &p in to_run {
        let takes = library
            .implementation(&graph.nodes[p].class_type)
            .is_some_and(|imp| imp.takes_image_tail());
        if !takes {
            continue;
        }
        let mut tail = Vec::new();
        let mut cur = p;
        while let Some(&[(j, name, 0)]) = readers.get(&cur).map(Vec::as_slice) {
            let node = &graph.nodes[j];
            let Some(imp) = library.implementation(&node.class_type) else {
                break;
            };
            if node.output_node {
                break;
            }
            // The image is the node's only link; the rest are constants.
            let mut consts = HashMap::new();
            let mut links = 0;
            for (n, inp) in &node.inputs {
                match inp {
                    GraphInput::Const(v) => {
                        consts.insert(n.clone(), v.clone());
                    }
                    GraphInput::Link { .. } => links += 1,
                }
            }
            if links != 1 {
                break;
            }
            let Some(stage) = imp.image_stage(&Inputs::new(consts.clone())) else {
                break;
            };
            if stage.input != name {
                break;
            }
            tail.push(Member {
                index: j,
                stage,
                imp,
                consts,
                ctx: None,
            });
            cur = j;
        }
        if !tail.is_empty() {
            chains.insert(p, tail);
        }
    }
    chains
}

/// What a scheduled task did: the nodes it finished in order, the outputs
/// of those that have one on the host, and the node that failed.
#[derive(Default)]
pub(crate) struct Done {
    pub finished: Vec<usize>,
    pub outputs: Vec<(usize, NodeOutput)>,
    pub failure: Option<(usize, NodeError)>,
}

/// Refuses what cannot fit before it allocates, and turns a panic (a bug)
/// into the node's error rather than the server's end.
pub(crate) fn guarded<O>(
    imp: &dyn NodeImpl,
    ctx: &NodeContext,
    inputs: &Inputs,
    run: impl FnOnce() -> Result<O, NodeError>,
) -> Result<O, NodeError> {
    crate::memory::admit(imp, ctx, inputs)?;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(p) => Err(NodeError::invalid(format!(
            "internal error (panic): {}",
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default()
        ))),
    }
}

/// Runs producer `i` with its tail in one program, or, where it declines,
/// it and each member in turn.
pub(crate) fn run_chain(
    i: usize,
    imp: &dyn NodeImpl,
    ctx: &NodeContext,
    inputs: &Inputs,
    tail: Vec<Member>,
) -> Done {
    let mut done = Done::default();
    let (stages, members): (Vec<ImageStage>, Vec<_>) = tail
        .into_iter()
        .map(|m| (m.stage, (m.index, m.imp, m.consts, m.ctx)))
        .unzip();
    let fused = guarded(imp, ctx, inputs, || {
        imp.execute_with_tail(ctx, inputs, &stages).transpose()
    });
    match fused {
        Ok(Some(out)) => {
            done.finished.push(i);
            done.finished.extend(members.iter().map(|m| m.0));
            if let Some(last) = members.last() {
                done.outputs.push((last.0, out));
            }
            return done;
        }
        // Declined: node by node below.
        Ok(None) => {}
        Err(e) => {
            done.failure = Some((i, e));
            return done;
        }
    }
    let mut image = match guarded(imp, ctx, inputs, || imp.execute(ctx, inputs)) {
        Ok(out) => {
            let v = out.values.first().cloned();
            done.finished.push(i);
            done.outputs.push((i, out));
            v
        }
        Err(e) => {
            done.failure = Some((i, e));
            return done;
        }
    };
    for ((j, imp, mut consts, ctx), stage) in members.into_iter().zip(&stages) {
        let (Some(v), Some(ctx)) = (image.take(), ctx) else {
            done.failure = Some((j, NodeError::invalid("no image from the node before")));
            return done;
        };
        consts.insert(stage.input.to_string(), v);
        let inputs = Inputs::new(consts);
        match guarded(imp.as_ref(), &ctx, &inputs, || imp.execute(&ctx, &inputs)) {
            Ok(out) => {
                image = out.values.first().cloned();
                done.finished.push(j);
                done.outputs.push((j, out));
            }
            Err(e) => {
                done.failure = Some((j, e));
                return done;
            }
        }
    }
    done
}
