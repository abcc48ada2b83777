//! Validation: a [`Workflow`] document becomes a typed, acyclic [`Graph`],
//! or the full list of what is wrong with it.

use crate::value::Value;
use petgraph::graph::{DiGraph, NodeIndex};
use sdkit_schema::export::ComboSource;
use sdkit_schema::spec::InputKind;
use sdkit_schema::workflow::{InputValue, OutputRef};
use sdkit_schema::{DiagKind, Diagnostic, Format, Registry, Severity, SocketType, Workflow};
use serde_json::Value as Json;

/// A validated input.
#[derive(Clone, Debug)]
pub enum GraphInput {
    /// A constant, coerced to the declared widget type.
    Const(Value),
    /// Output `output` of the node at index `node` in [`Graph::nodes`].
    Link { node: usize, output: usize },
}

#[derive(Clone, Debug)]
pub struct GraphNode {
    pub id: String,
    pub class_type: String,
    /// In the spec's input order.
    pub inputs: Vec<(String, GraphInput)>,
    pub output_node: bool,
}

/// A validated workflow: every node type known, every link typed, no cycle.
#[derive(Clone, Debug)]
pub struct Graph {
    pub nodes: Vec<GraphNode>,
    /// Node indices in an order that respects every link.
    pub order: Vec<usize>,
    pub dag: DiGraph<usize, ()>,
    /// The workflow in ComfyUI API form, with links by index; shared with
    /// every node of a run.
    pub api_json: std::sync::Arc<Json>,
    /// The UI workflow, when the file was one (PNG `workflow` chunk).
    pub ui_workflow: Option<Json>,
    /// Non-fatal diagnostics.
    pub warnings: Vec<Diagnostic>,
    /// Under [`Outputs::Valid`], the errors of the output nodes that were
    /// dropped (their `output_node` is false): ComfyUI runs the valid
    /// outputs of a prompt and reports these as its `node_errors`.
    pub dropped: Vec<Diagnostic>,
}

/// Which outputs a workflow with errors may still run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outputs {
    /// Any error refuses the whole workflow (`sdkit validate`, `--strict`).
    All,
    /// ComfyUI's `/prompt` rule: an output whose branch has an error is
    /// dropped and reported, the others run; only a workflow with no valid
    /// output, or a prompt-wide problem (an unknown node type anywhere, a
    /// syntax error), is refused. Errors and cycles among nodes no output
    /// uses are warnings.
    Valid,
}

impl Graph {
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    /// Indices of the output nodes.
    pub fn outputs(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].output_node)
            .collect()
    }

    /// The nodes the output nodes depend on (themselves included), in
    /// execution order.
    pub fn needed(&self) -> Vec<usize> {
        let mut keep = vec![false; self.nodes.len()];
        let mut stack = self.outputs();
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut keep[i], true) {
                continue;
            }
            for (_, inp) in &self.nodes[i].inputs {
                if let GraphInput::Link { node, .. } = inp {
                    stack.push(*node);
                }
            }
        }
        self.order.iter().copied().filter(|&i| keep[i]).collect()
    }
}

/// Converts a JSON constant to the value a widget declares, following
/// ComfyUI's `int()`, `float()`, `str()` coercions.
fn coerce(kind: &InputKind, v: &Json) -> Result<Value, String> {
    match kind {
        InputKind::Int { .. } => match v {
            Json::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Ok(Value::Int(i as i128))
                } else if let Some(u) = n.as_u64() {
                    Ok(Value::Int(u as i128))
                } else {
                    // Python's int() truncates floats toward zero.
                    let f = n.as_f64().unwrap_or(f64::NAN);
                    if f.is_finite() {
                        Ok(Value::Int(f.trunc() as i128))
                    } else {
                        Err(format!("{f} is not an integer"))
                    }
                }
            }
            Json::Bool(b) => Ok(Value::Int(*b as i128)),
            Json::String(s) => s
                .trim()
                .parse::<i128>()
                .map(Value::Int)
                .map_err(|_| format!("\"{s}\" is not an integer")),
            other => Err(format!("expected an integer, found {other}")),
        },
        InputKind::Float { .. } => match v {
            Json::Number(n) => Ok(Value::Float(n.as_f64().unwrap_or(f64::NAN))),
            Json::Bool(b) => Ok(Value::Float(*b as i32 as f64)),
            Json::String(s) => s
                .trim()
                .parse::<f64>()
                .map(Value::Float)
                .map_err(|_| format!("\"{s}\" is not a number")),
            other => Err(format!("expected a number, found {other}")),
        },
        InputKind::String { .. } | InputKind::Combo { .. } => match v {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Number(n) => Ok(Value::String(n.to_string())),
            Json::Bool(b) => Ok(Value::String(if *b { "True" } else { "False" }.into())),
            other => Err(format!("expected a string, found {other}")),
        },
        InputKind::Boolean { .. } => match v {
            Json::Bool(b) => Ok(Value::Bool(*b)),
            Json::Number(n) => Ok(Value::Bool(n.as_f64().unwrap_or(0.0) != 0.0)),
            // Python's bool("false") is True; a config file that says
            // "false" means false, so strings are read by their words.
            Json::String(s) => match s.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Ok(Value::Bool(true)),
                "false" | "0" | "no" | "off" | "" => Ok(Value::Bool(false)),
                _ => Err(format!("\"{s}\" is not a boolean")),
            },
            other => Err(format!("expected a boolean, found {other}")),
        },
        InputKind::Socket(t) => Err(format!("expected a link to a {t} output, found {v}")),
    }
}

/// Checks min/max and combo membership of a coerced constant.
fn check_range(
    kind: &InputKind,
    v: &Value,
    combos: &dyn ComboSource,
) -> Option<(DiagKind, String)> {
    match (kind, v) {
        (InputKind::Int { min, max, .. }, Value::Int(i)) => {
            if i < min {
                Some((
                    DiagKind::ValueSmallerThanMin,
                    format!("Value {i} smaller than min of {min}"),
                ))
            } else if i > max {
                Some((
                    DiagKind::ValueBiggerThanMax,
                    format!("Value {i} bigger than max of {max}"),
                ))
            } else {
                None
            }
        }
        (InputKind::Float { min, max, .. }, Value::Float(f)) => {
            if f.is_nan() {
                Some((DiagKind::InvalidInputType, "value is NaN".into()))
            } else if f < min {
                Some((
                    DiagKind::ValueSmallerThanMin,
                    format!("Value {f} smaller than min of {min}"),
                ))
            } else if f > max {
                Some((
                    DiagKind::ValueBiggerThanMax,
                    format!("Value {f} bigger than max of {max}"),
                ))
            } else {
                None
            }
        }
        (InputKind::Combo { options, .. }, Value::String(s)) => {
            if combos.contains(options, s) {
                None
            } else {
                let opts = combos.options(options);
                let list = if opts.len() > 20 {
                    format!("(list of length {})", opts.len())
                } else {
                    format!("{opts:?}")
                };
                let hint = combos.missing_hint(options).map(|h| format!(" — {h}"));
                Some((
                    DiagKind::ValueNotInList,
                    format!(
                        "Value not in list: '{s}' not in {list}{}",
                        hint.unwrap_or_default()
                    ),
                ))
            }
        }
        _ => None,
    }
}

/// Validates a workflow against the registry.
///
/// Returns the graph (with any warnings in [`Graph::warnings`]) or every
/// error found, each naming the node, type, input and file position.
pub fn validate(
    wf: &Workflow,
    registry: &Registry,
    combos: &dyn ComboSource,
) -> Result<Graph, Vec<Diagnostic>> {
    check(wf, registry, None, combos, Outputs::All)
}

/// [`validate`] for running with `library`: also reports node types that
/// are registered but not implemented, where an output needs them, so a
/// front end shows them before anything runs; `outputs` says what errors
/// refuse.
pub fn validate_for(
    wf: &Workflow,
    library: &crate::node::NodeLibrary,
    combos: &dyn ComboSource,
    outputs: Outputs,
) -> Result<Graph, Vec<Diagnostic>> {
    check(
        wf,
        &library.registry,
        Some(&|t: &str| library.is_implemented(t)),
        combos,
        outputs,
    )
}

fn check(
    wf: &Workflow,
    registry: &Registry,
    implemented: Option<&dyn Fn(&str) -> bool>,
    combos: &dyn ComboSource,
    mode: Outputs,
) -> Result<Graph, Vec<Diagnostic>> {
    let mut diags: Vec<Diagnostic> = wf.warnings.clone();
    // For ComfyUI files an input we do not know is likely from a newer
    // ComfyUI and is ignored as ComfyUI ignores it; in hand-written files it
    // is likely a typo.
    let unknown_severity = match wf.format {
        Format::Native => Severity::Error,
        _ => Severity::Warning,
    };
    let index = wf.index_by_id();
    let specs = wf.specs(registry);
    let mut nodes = Vec::with_capacity(wf.nodes.len());
    // Which nodes each diagnostic belongs to, to soften those on nodes no
    // output needs (ComfyUI skips them).
    let mut diag_nodes: Vec<Option<usize>> = vec![None; diags.len()];
    let mut edges = Vec::new();

    for (ni, doc) in wf.nodes.iter().enumerate() {
        let here = |d: Diagnostic| d.node(&doc.id, &doc.class_type);
        let Some(spec) = specs[ni] else {
            diags.push(
                here(Diagnostic::error(
                    DiagKind::MissingNodeType,
                    format!(
                        "Cannot execute because node {} does not exist.",
                        doc.class_type
                    ),
                ))
                .at(doc.pos),
            );
            diag_nodes.push(Some(ni));
            nodes.push(GraphNode {
                id: doc.id.clone(),
                class_type: doc.class_type.clone(),
                inputs: Vec::new(),
                output_node: false,
            });
            continue;
        };
        let mut inputs = Vec::new();
        for input in &doc.inputs {
            if spec.input(&input.name).is_none() {
                let mut d = here(Diagnostic::error(
                    DiagKind::UnknownInput,
                    format!(
                        "{} has no input \"{}\"{}",
                        spec.name,
                        input.name,
                        suggest(&input.name, spec.inputs.iter().map(|i| i.name.as_str()))
                    ),
                ))
                .input(&input.name)
                .at(input.pos);
                d.severity = unknown_severity;
                diags.push(d);
                diag_nodes.push(Some(ni));
            }
        }
        for ispec in &spec.inputs {
            let doc_input = doc.input(&ispec.name);
            let Some(doc_input) = doc_input else {
                if ispec.required {
                    diags.push(
                        here(Diagnostic::error(
                            DiagKind::RequiredInputMissing,
                            "Required input is missing",
                        ))
                        .input(&ispec.name)
                        .at(doc.pos),
                    );
                    diag_nodes.push(Some(ni));
                }
                continue;
            };
            let mut err = |kind: DiagKind, msg: String| {
                diags.push(
                    here(Diagnostic::error(kind, msg))
                        .input(&ispec.name)
                        .at(doc_input.pos),
                );
                diag_nodes.push(Some(ni));
            };
            match &doc_input.value {
                InputValue::Link(link) => {
                    let Some(&src) = index.get(link.node.as_str()) else {
                        err(
                            DiagKind::BadLinkedInput,
                            format!("links to node \"{}\", which does not exist", link.node),
                        );
                        continue;
                    };
                    edges.push((src, ni));
                    let Some(src_spec) = specs[src] else {
                        // The unknown source type is reported on its own node.
                        continue;
                    };
                    let out = match &link.output {
                        OutputRef::Index(k) if *k < src_spec.outputs.len() => *k,
                        OutputRef::Index(k) => {
                            err(
                                DiagKind::BadLinkedInput,
                                format!(
                                    "links to output {k} of node \"{}\" ({}), which has {} output(s)",
                                    link.node,
                                    src_spec.name,
                                    src_spec.outputs.len()
                                ),
                            );
                            continue;
                        }
                        OutputRef::Name(name) => match src_spec.output_index(name) {
                            Some(k) => k,
                            None => {
                                let names: Vec<&str> =
                                    src_spec.outputs.iter().map(|o| o.name.as_str()).collect();
                                err(
                                    DiagKind::BadLinkedInput,
                                    format!(
                                        "node \"{}\" ({}) has no output \"{name}\"; its outputs are {names:?}",
                                        link.node, src_spec.name
                                    ),
                                );
                                continue;
                            }
                        },
                    };
                    let received = &src_spec.outputs[out].ty;
                    let expected = ispec.kind.socket_type();
                    let combo_ok = matches!(ispec.kind, InputKind::Combo { .. })
                        && matches!(received, SocketType::String | SocketType::Custom(_));
                    if !expected.accepts(received) && !combo_ok {
                        err(
                            DiagKind::ReturnTypeMismatch,
                            format!(
                                "Return type mismatch between linked nodes: received_type({received}) mismatch input_type({expected})"
                            ),
                        );
                        continue;
                    }
                    inputs.push((
                        ispec.name.clone(),
                        GraphInput::Link {
                            node: src,
                            output: out,
                        },
                    ));
                }
                InputValue::Const(c) => {
                    let v = match coerce(&ispec.kind, c) {
                        Ok(v) => v,
                        Err(msg) => {
                            let kind = if matches!(ispec.kind, InputKind::Socket(_)) {
                                DiagKind::BadLinkedInput
                            } else {
                                DiagKind::InvalidInputType
                            };
                            err(kind, msg);
                            continue;
                        }
                    };
                    if let Some((kind, msg)) = check_range(&ispec.kind, &v, combos) {
                        err(kind, msg);
                        continue;
                    }
                    inputs.push((ispec.name.clone(), GraphInput::Const(v)));
                }
            }
        }
        nodes.push(GraphNode {
            id: doc.id.clone(),
            class_type: doc.class_type.clone(),
            inputs,
            output_node: spec.output_node,
        });
    }

    let mut dag: DiGraph<usize, ()> = DiGraph::new();
    let idx: Vec<NodeIndex> = (0..nodes.len()).map(|i| dag.add_node(i)).collect();
    for &(a, b) in &edges {
        dag.add_edge(idx[a], idx[b], ());
    }
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for &(a, b) in &edges {
        preds[b].push(a);
    }
    let outputs: Vec<usize> = (0..nodes.len()).filter(|&i| nodes[i].output_node).collect();
    let reach = ancestors(&outputs, &preds);

    // Components in topological order (kosaraju gives them sinks first;
    // it is iterative, where tarjan recurses per node of a long chain);
    // one of more than one node, or with a self-link, is a cycle.
    let mut sccs = petgraph::algo::kosaraju_scc(&dag);
    sccs.reverse();
    let mut cyclic = vec![false; nodes.len()];
    for scc in &sccs {
        if scc.len() > 1 || dag.contains_edge(scc[0], scc[0]) {
            for &n in scc {
                cyclic[dag[n]] = true;
            }
            let mut ids: Vec<&str> = scc.iter().map(|&n| wf.nodes[dag[n]].id.as_str()).collect();
            ids.sort();
            // The first id in sorted order, so the report is stable.
            let first = scc
                .iter()
                .map(|&n| dag[n])
                .min_by_key(|&i| wf.nodes[i].id.as_str())
                .unwrap_or(dag[scc[0]]);
            let shown = if ids.len() > 20 {
                format!("{:?} and {} more", &ids[..20], ids.len() - 20)
            } else {
                format!("{ids:?}")
            };
            diags.push(
                Diagnostic::error(
                    DiagKind::DependencyCycle,
                    format!("nodes {shown} depend on each other in a cycle"),
                )
                .node(&wf.nodes[first].id, &wf.nodes[first].class_type)
                .at(wf.nodes[first].pos),
            );
            diag_nodes.push(Some(first));
        }
    }
    // petgraph's toposort when there is no cycle (the order runs have
    // always used); else the components' order, whose cyclic members never
    // run (they are errors, or unused).
    let order: Vec<usize> = match petgraph::algo::toposort(&dag, None) {
        Ok(o) => o.into_iter().map(|n| dag[n]).collect(),
        Err(_) => sccs.iter().flatten().map(|&n| dag[n]).collect(),
    };

    if outputs.is_empty() {
        diags.push(Diagnostic::error(
            DiagKind::PromptNoOutputs,
            "Prompt has no outputs: add an output node such as SaveImage or PreviewImage",
        ));
        diag_nodes.push(None);
    }

    // Registered types without an implementation, where an output needs
    // them: reported now rather than when the run reaches them.
    if let Some(implemented) = implemented {
        for (i, node) in nodes.iter().enumerate() {
            if reach[i] && specs[i].is_some() && !implemented(&node.class_type) {
                diags.push(
                    Diagnostic::error(
                        DiagKind::NotImplemented,
                        format!(
                            "node type {} is not implemented yet in sdkit",
                            node.class_type
                        ),
                    )
                    .node(&node.id, &node.class_type)
                    .at(wf.nodes[i].pos),
                );
                diag_nodes.push(Some(i));
            }
        }
    }

    // ComfyUI validates only what its output nodes need: errors on other
    // nodes are warnings for ComfyUI files (they run there) and under
    // `Outputs::Valid`. An unknown node type refuses the prompt wherever
    // it is, as ComfyUI refuses it.
    if wf.format != Format::Native || mode == Outputs::Valid {
        for (d, n) in diags.iter_mut().zip(&diag_nodes) {
            if let Some(n) = *n {
                if !reach[n] && d.is_error() && d.kind != DiagKind::MissingNodeType {
                    let strict_cycle = d.kind == DiagKind::DependencyCycle && mode == Outputs::All;
                    if !strict_cycle {
                        d.severity = Severity::Warning;
                        d.message = format!(
                            "{} (ignored: no output node uses node \"{}\")",
                            d.message, wf.nodes[n].id
                        );
                    }
                }
            }
        }
    }

    if !diags.iter().any(Diagnostic::is_error) {
        return Ok(finish(wf, registry, nodes, order, dag, diags, Vec::new()));
    }
    let prompt_wide = diags
        .iter()
        .zip(&diag_nodes)
        .any(|(d, n)| d.is_error() && (n.is_none() || d.kind == DiagKind::MissingNodeType));
    if mode == Outputs::All || prompt_wide {
        return Err(diags);
    }

    // A node is bad when it, or anything it depends on, has an error or
    // sits on a cycle; an output that is bad is dropped.
    let mut failed = vec![false; nodes.len()];
    for (d, n) in diags.iter().zip(&diag_nodes) {
        if let (true, Some(n)) = (d.is_error(), *n) {
            failed[n] = true;
        }
    }
    let mut bad = vec![false; nodes.len()];
    for scc in &sccs {
        let members: Vec<usize> = scc.iter().map(|&n| dag[n]).collect();
        let b = members
            .iter()
            .any(|&i| failed[i] || cyclic[i] || preds[i].iter().any(|&p| bad[p]));
        for i in members {
            bad[i] = b;
        }
    }
    if outputs.iter().all(|&o| bad[o]) {
        return Err(diags);
    }
    for &o in &outputs {
        if bad[o] {
            nodes[o].output_node = false;
        }
    }
    let (dropped, warnings): (Vec<Diagnostic>, Vec<Diagnostic>) =
        diags.into_iter().partition(Diagnostic::is_error);
    Ok(finish(wf, registry, nodes, order, dag, warnings, dropped))
}

fn finish(
    wf: &Workflow,
    registry: &Registry,
    nodes: Vec<GraphNode>,
    order: Vec<usize>,
    dag: DiGraph<usize, ()>,
    warnings: Vec<Diagnostic>,
    dropped: Vec<Diagnostic>,
) -> Graph {
    Graph {
        api_json: std::sync::Arc::new(wf.to_api_json(registry)),
        ui_workflow: wf.ui_workflow.clone(),
        nodes,
        order,
        dag,
        warnings,
        dropped,
    }
}

/// Which nodes the `roots` depend on (themselves included), by `preds`.
fn ancestors(roots: &[usize], preds: &[Vec<usize>]) -> Vec<bool> {
    let mut reach = vec![false; preds.len()];
    let mut stack = roots.to_vec();
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut reach[i], true) {
            stack.extend(&preds[i]);
        }
    }
    reach
}

/// "; did you mean `x`?" for a close name, else "".
fn suggest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> String {
    let best = candidates
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3))
        .min();
    best.map_or(String::new(), |(_, c)| format!("; did you mean \"{c}\"?"))
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// A node as (id, type, [(input, value or link)]), for comparing graphs.
pub type CanonicalNode = (String, String, Vec<(String, String)>);

/// The validated graph in a comparable form, sorted by node id: tests use
/// it to check that different file forms give the same graph.
pub fn canonical(graph: &Graph) -> Vec<CanonicalNode> {
    let mut out: Vec<_> = graph
        .nodes
        .iter()
        .map(|n| {
            let inputs = n
                .inputs
                .iter()
                .map(|(name, i)| {
                    let v = match i {
                        GraphInput::Const(v) => format!("{v:?}"),
                        GraphInput::Link { node, output } => {
                            format!("link({}, {output})", graph.nodes[*node].id)
                        }
                    };
                    (name.clone(), v)
                })
                .collect();
            (n.id.clone(), n.class_type.clone(), inputs)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
