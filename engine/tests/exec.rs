//! Executor properties on random DAGs: dependency order, caching that
//! re-runs exactly the edited node and its descendants, errors and
//! cancellation.

use proptest::prelude::*;
use sdkit_engine::event::discard;
use sdkit_engine::{
    validate, CancelToken, Event, Executor, Inputs, NodeContext, NodeError, NodeImpl, NodeLibrary,
    NodeOutput, Paths, RunError, RunOptions, Value,
};
use sdkit_schema::export::StaticOnly;
use sdkit_schema::spec::node;
use sdkit_schema::workflow::{InputDoc, InputValue, Link, NodeDoc, OutputRef};
use sdkit_schema::{Format, Registry, SocketType, Workflow};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

type Log = Arc<Mutex<Vec<String>>>;

/// Sums its constant and its linked inputs; logs each execution.
struct Sum {
    log: Log,
}

impl NodeImpl for Sum {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let mut total = inputs.int("value")?;
        for name in ["a", "b", "c"] {
            if inputs.get(name).is_some() {
                total += inputs.int(name)?;
            }
        }
        if total == 666 {
            return Err(NodeError::invalid("the number of the beast"));
        }
        if total == 999 {
            ctx.cancel.cancel();
            ctx.check_cancel()?;
        }
        self.log.lock().expect("log lock").push(ctx.node_id.clone());
        Ok(NodeOutput::values(vec![Value::Int(total)]))
    }
}

struct Sink {
    log: Log,
}

impl NodeImpl for Sink {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let v = inputs.int("x")?;
        self.log.lock().expect("log lock").push(ctx.node_id.clone());
        Ok(NodeOutput {
            values: vec![],
            ui: Some(serde_json::json!({ "value": [v.to_string()] })),
        })
    }
}

fn library(log: &Log) -> NodeLibrary {
    let mut reg = Registry::new();
    reg.insert(
        node("Sum", "test")
            .int("value", 0, -1000, 1000, 1)
            .optional_socket("a", SocketType::Int)
            .optional_socket("b", SocketType::Int)
            .optional_socket("c", SocketType::Int)
            .returns(SocketType::Int)
            .build(),
    );
    reg.insert(
        node("Sink", "test")
            .socket("x", SocketType::Int)
            .output_node()
            .build(),
    );
    let mut lib = NodeLibrary::new(reg);
    lib.implement("Sum", Sum { log: log.clone() });
    lib.implement("Sink", Sink { log: log.clone() });
    lib
}

/// A DAG of `n` Sum nodes (edges from lower to higher index) with a Sink on
/// every node that nothing consumes.
fn build(n: usize, parents: &[Vec<usize>], values: &[i64]) -> Workflow {
    let mut nodes = Vec::new();
    let mut consumed = vec![false; n];
    for j in 0..n {
        let mut inputs = vec![InputDoc {
            name: "value".into(),
            value: InputValue::Const(values[j].into()),
            pos: None,
        }];
        for (slot, &p) in parents[j].iter().enumerate() {
            consumed[p] = true;
            inputs.push(InputDoc {
                name: ["a", "b", "c"][slot].into(),
                value: InputValue::Link(Link {
                    node: format!("n{p}"),
                    output: OutputRef::Index(0),
                }),
                pos: None,
            });
        }
        nodes.push(NodeDoc {
            id: format!("n{j}"),
            class_type: "Sum".into(),
            inputs,
            title: None,
            pos: None,
        });
    }
    for (j, _) in consumed.iter().enumerate().filter(|(_, c)| !**c) {
        nodes.push(NodeDoc {
            id: format!("sink{j}"),
            class_type: "Sink".into(),
            inputs: vec![InputDoc {
                name: "x".into(),
                value: InputValue::Link(Link {
                    node: format!("n{j}"),
                    output: OutputRef::Name("INT".into()),
                }),
                pos: None,
            }],
            title: None,
            pos: None,
        });
    }
    Workflow {
        format: Format::Native,
        nodes,
        ui_workflow: None,
        warnings: vec![],
    }
}

fn dag_strategy() -> impl Strategy<Value = (usize, Vec<Vec<usize>>, Vec<i64>, usize, i64)> {
    (2usize..14).prop_flat_map(|n| {
        let parents = (0..n)
            .map(|j| {
                if j == 0 {
                    Just(Vec::new()).boxed()
                } else {
                    proptest::collection::btree_set(0..j, 0..=3.min(j))
                        .prop_map(|s| s.into_iter().collect::<Vec<_>>())
                        .boxed()
                }
            })
            .collect::<Vec<_>>();
        (
            Just(n),
            parents,
            proptest::collection::vec(-5i64..5, n),
            0..n,
            10i64..20,
        )
    })
}

fn descendants(n: usize, parents: &[Vec<usize>], k: usize) -> BTreeSet<usize> {
    let mut out = BTreeSet::from([k]);
    for (j, ps) in parents.iter().enumerate().take(n).skip(k + 1) {
        if ps.iter().any(|p| out.contains(p)) {
            out.insert(j);
        }
    }
    out
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn order_respects_edges_and_edits_rerun_exactly_descendants(
        (n, parents, values, k, new_value) in dag_strategy()
    ) {
        let rt = runtime();
        let log: Log = Arc::default();
        let lib = Arc::new(library(&log));
        let exec = Executor::new(lib.clone(), Arc::new(Paths::under(std::path::Path::new("/nonexistent"))));
        let wf = build(n, &parents, &values);
        let graph = validate(&wf, &lib.registry, &StaticOnly).expect("valid");
        let report = rt.block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new()))).expect("runs");
        let first: Vec<String> = log.lock().expect("log").clone();
        prop_assert_eq!(first.len(), graph.nodes.len());
        prop_assert_eq!(report.executed.len(), graph.nodes.len());
        let pos: HashMap<&str, usize> = first.iter().enumerate().map(|(i, s)| (s.as_str(), i)).collect();
        for (j, ps) in parents.iter().enumerate() {
            for p in ps {
                let (src, dst) = (format!("n{p}"), format!("n{j}"));
                prop_assert!(pos[src.as_str()] < pos[dst.as_str()], "{} ran after {}", src, dst);
            }
        }

        // Unchanged re-run: everything cached.
        log.lock().expect("log").clear();
        let report = rt.block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new()))).expect("runs");
        prop_assert!(log.lock().expect("log").is_empty());
        prop_assert_eq!(report.cached.len(), graph.nodes.len());

        // Edit node k: exactly k, its descendants and their sinks re-run.
        let mut values2 = values.clone();
        values2[k] = new_value;
        let wf2 = build(n, &parents, &values2);
        let graph2 = validate(&wf2, &lib.registry, &StaticOnly).expect("valid");
        log.lock().expect("log").clear();
        rt.block_on(exec.run(&graph2, RunOptions::new(discard(), CancelToken::new()))).expect("runs");
        let ran: BTreeSet<String> = log.lock().expect("log").iter().cloned().collect();
        let d = descendants(n, &parents, k);
        let mut expected: BTreeSet<String> = d.iter().map(|j| format!("n{j}")).collect();
        for w in &wf2.nodes {
            if w.class_type == "Sink" {
                let src: usize = w.id.trim_start_matches("sink").parse().expect("sink id");
                if d.contains(&src) {
                    expected.insert(w.id.clone());
                }
            }
        }
        prop_assert_eq!(ran, expected);
    }
}

#[test]
fn node_errors_and_interrupts_are_reported() {
    let rt = runtime();
    let log: Log = Arc::default();
    let lib = Arc::new(library(&log));
    let exec = Executor::new(
        lib.clone(),
        Arc::new(Paths::under(std::path::Path::new("/nonexistent"))),
    );
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let ev = events.clone();
    let sink: sdkit_engine::EventSink =
        Arc::new(move |e| ev.lock().expect("events").push(e.clone()));

    let wf = build(2, &[vec![], vec![0]], &[600, 66]);
    let graph = validate(&wf, &lib.registry, &StaticOnly).expect("valid");
    let err = rt
        .block_on(exec.run(&graph, RunOptions::new(sink.clone(), CancelToken::new())))
        .expect_err("fails");
    assert!(
        matches!(err, RunError::Node { ref node_id, .. } if node_id == "n1"),
        "{err}"
    );
    let names: Vec<&str> = events
        .lock()
        .expect("events")
        .iter()
        .map(Event::name)
        .collect::<Vec<_>>()
        .into_iter()
        .collect();
    assert!(names.contains(&"execution_error"), "{names:?}");
    assert!(!names.contains(&"execution_success"));

    events.lock().expect("events").clear();
    let wf = build(2, &[vec![], vec![0]], &[900, 99]);
    let graph = validate(&wf, &lib.registry, &StaticOnly).expect("valid");
    let err = rt
        .block_on(exec.run(&graph, RunOptions::new(sink.clone(), CancelToken::new())))
        .expect_err("interrupted");
    assert!(matches!(err, RunError::Interrupted));
    let names: Vec<String> = events
        .lock()
        .expect("events")
        .iter()
        .map(|e| e.name().to_string())
        .collect();
    // ComfyUI's order: the interruption, then `executing` with no node.
    let n = names.len();
    assert_eq!(
        names.get(n.wrapping_sub(2)).map(String::as_str),
        Some("execution_interrupted"),
        "{names:?}"
    );
    assert_eq!(names.last().map(String::as_str), Some("executing"));
}

#[test]
fn unimplemented_node_fails_clearly() {
    let rt = runtime();
    let mut reg = Registry::new();
    reg.insert(node("Later", "test").returns(SocketType::Int).build());
    reg.insert(
        node("Sink", "test")
            .socket("x", SocketType::Int)
            .output_node()
            .build(),
    );
    let lib = Arc::new(NodeLibrary::new(reg));
    let exec = Executor::new(
        lib.clone(),
        Arc::new(Paths::under(std::path::Path::new("/x"))),
    );
    let text =
        r#"{"nodes": {"a": {"type": "Later"}, "b": {"type": "Sink", "inputs": {"x": ["a", 0]}}}}"#;
    let wf = sdkit_schema::workflow::load(text, &lib.registry).expect("loads");
    let graph = validate(&wf, &lib.registry, &StaticOnly).expect("valid");
    let err = rt
        .block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new())))
        .expect_err("fails");
    assert!(err.to_string().contains("not implemented yet"), "{err}");
}

/// Sleeps, recording when it ran.
struct Nap {
    spans: Arc<Mutex<Vec<(std::time::Instant, std::time::Instant)>>>,
}

impl NodeImpl for Nap {
    fn execute(&self, _ctx: &NodeContext, _inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let start = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(300));
        self.spans
            .lock()
            .expect("spans")
            .push((start, std::time::Instant::now()));
        Ok(NodeOutput::values(vec![Value::Int(1)]))
    }
}

#[test]
fn independent_branches_run_concurrently() {
    let rt = runtime();
    let log: Log = Arc::default();
    let spans: Arc<Mutex<Vec<(std::time::Instant, std::time::Instant)>>> = Arc::default();
    let mut reg = library(&log).registry;
    reg.insert(node("Nap", "test").returns(SocketType::Int).build());
    let mut lib = NodeLibrary::new(reg);
    lib.implement(
        "Nap",
        Nap {
            spans: spans.clone(),
        },
    );
    lib.implement("Sink", Sink { log: log.clone() });
    let lib = Arc::new(lib);
    let text = r#"(nodes: {
        "a": Nap(), "b": Nap(),
        "sa": Sink(x: ("a", 0)), "sb": Sink(x: ("b", 0)),
    })"#;
    let wf = sdkit_schema::workflow::load(text, &lib.registry).expect("loads");
    let graph = validate(&wf, &lib.registry, &StaticOnly).expect("valid");
    let exec = Executor::new(lib, Arc::new(Paths::under(std::path::Path::new("/x"))));
    rt.block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new())))
        .expect("runs");
    let s = spans.lock().expect("spans");
    assert_eq!(s.len(), 2);
    // The two naps overlap in time: neither ended before the other began.
    assert!(
        s[0].0 < s[1].1 && s[1].0 < s[0].1,
        "ran one after the other"
    );
}
