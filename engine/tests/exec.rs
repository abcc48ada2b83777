//! Executor properties on random DAGs: dependency order, caching that
//! re-runs exactly the edited node and its descendants, errors and
//! cancellation.

use proptest::prelude::*;
use sdkit_engine::event::discard;
use sdkit_engine::{
    validate, validate_for, CancelToken, Event, Executor, Inputs, NodeContext, NodeError, NodeImpl,
    NodeLibrary, NodeOutput, Outputs, Paths, RunError, RunOptions, Value,
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

    // Validation for running reports it before anything runs, on the node.
    // (Neither type has an implementation in this library.)
    let d = validate_for(&wf, &lib, &StaticOnly, Outputs::Valid).expect_err("refused");
    let ids: Vec<(&str, Option<&str>)> = d
        .iter()
        .map(|d| (d.kind.as_str(), d.node_id.as_deref()))
        .collect();
    assert_eq!(
        ids,
        [
            ("node_not_implemented", Some("a")),
            ("node_not_implemented", Some("b"))
        ]
    );
    // Not where no output needs it.
    let log: Log = Arc::default();
    let mut lib = library(&log);
    lib.registry
        .insert(node("Later", "test").returns(SocketType::Int).build());
    let text = r#"{"nodes": {"a": {"type": "Later"}, "n": {"type": "Sum", "inputs": {"value": 1}},
        "s": {"type": "Sink", "inputs": {"x": ["n", 0]}}}}"#;
    let wf = sdkit_schema::workflow::load(text, &lib.registry).expect("loads");
    validate_for(&wf, &lib, &StaticOnly, Outputs::All).expect("valid");
}

/// A chain of Sum nodes `n0 → n1 → … → n{len-1}` with a Sink at its end.
fn chain(len: usize) -> Workflow {
    let parents: Vec<Vec<usize>> = (0..len)
        .map(|j| if j == 0 { vec![] } else { vec![j - 1] })
        .collect();
    build(len, &parents, &vec![0; len])
}

#[test]
fn long_chains_run_in_linear_time() {
    // Each node once copied the whole prompt: 2000 nodes took 19 s and
    // 10k never ended. Linear, 20k nodes take well under a second of
    // executor work; the bound only catches the quadratic form.
    let rt = runtime();
    let log: Log = Arc::default();
    let lib = Arc::new(library(&log));
    let exec = Executor::new(
        lib.clone(),
        Arc::new(Paths::under(std::path::Path::new("/x"))),
    );
    let wf = chain(20_000);
    let start = std::time::Instant::now();
    let graph = validate_for(&wf, &lib, &StaticOnly, Outputs::Valid).expect("valid");
    let report = rt
        .block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new())))
        .expect("runs");
    assert_eq!(report.executed.len(), 20_001);
    let took = start.elapsed();
    assert!(took < std::time::Duration::from_secs(60), "{took:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// ComfyUI's rule: an output runs exactly when nothing it depends on
    /// has an error; the errors of the others are reported, not fatal.
    #[test]
    fn only_outputs_whose_branch_is_valid_run(
        (n, parents, values, _k, _v) in dag_strategy(),
        broken in proptest::collection::btree_set(0usize..14, 0..3),
    ) {
        let broken: BTreeSet<usize> = broken.into_iter().filter(|&b| b < n).collect();
        let mut values = values;
        for &b in &broken {
            values[b] = 5000; // over the input's max of 1000
        }
        let log: Log = Arc::default();
        let lib = library(&log);
        let wf = build(n, &parents, &values);
        let sinks: Vec<usize> = (0..wf.nodes.len()).filter(|&i| wf.nodes[i].class_type == "Sink").collect();
        // Sink `s` reads the node its link names.
        let source = |s: usize| -> usize {
            match &wf.nodes[s].inputs[0].value {
                InputValue::Link(l) => l.node[1..].parse().expect("id"),
                InputValue::Const(_) => unreachable!(),
            }
        };
        let tainted: BTreeSet<usize> = broken.iter().flat_map(|&b| descendants(n, &parents, b)).collect();
        let good: BTreeSet<String> = sinks
            .iter()
            .filter(|&&s| !tainted.contains(&source(s)))
            .map(|&s| wf.nodes[s].id.clone())
            .collect();
        match validate_for(&wf, &lib, &StaticOnly, Outputs::Valid) {
            Ok(g) => {
                let kept: BTreeSet<String> = g.outputs().into_iter().map(|i| g.nodes[i].id.clone()).collect();
                prop_assert_eq!(&kept, &good);
                prop_assert_eq!(g.dropped.len(), broken.len());
            }
            Err(d) => {
                prop_assert!(good.is_empty(), "refused with valid outputs: {:?}", d);
                prop_assert_eq!(d.iter().filter(|d| d.is_error()).count(), broken.len());
            }
        }
        // Strict validation refuses whenever anything is broken.
        prop_assert_eq!(
            validate_for(&wf, &lib, &StaticOnly, Outputs::All).is_err(),
            !broken.is_empty()
        );
    }
}

#[test]
fn cycles_and_unknown_types_follow_comfyui() {
    let log: Log = Arc::default();
    let lib = library(&log);
    // A cycle among nodes no output uses: ignored under Outputs::Valid (a
    // warning), refused strictly; one an output uses is refused always.
    let unused = r#"{"1": {"class_type": "Sum", "inputs": {"value": 1}},
        "2": {"class_type": "Sink", "inputs": {"x": ["1", 0]}},
        "7": {"class_type": "Sum", "inputs": {"value": 1, "a": ["8", 0]}},
        "8": {"class_type": "Sum", "inputs": {"value": 1, "a": ["7", 0]}}}"#;
    let wf = sdkit_schema::workflow::load(unused, &lib.registry).expect("loads");
    let g = validate_for(&wf, &lib, &StaticOnly, Outputs::Valid).expect("runs");
    assert!(g
        .warnings
        .iter()
        .any(|d| d.kind.as_str() == "dependency_cycle"));
    assert!(validate_for(&wf, &lib, &StaticOnly, Outputs::All).is_err());
    let used = unused.replace(r#""x": ["1", 0]"#, r#""x": ["8", 0]"#);
    let wf = sdkit_schema::workflow::load(&used, &lib.registry).expect("loads");
    let d = validate_for(&wf, &lib, &StaticOnly, Outputs::Valid).expect_err("refused");
    assert!(
        d.iter().any(|d| d.kind.as_str() == "dependency_cycle"),
        "{d:?}"
    );
    // An unknown type refuses the prompt even where no output uses it.
    let unknown = r#"{"1": {"class_type": "Sum", "inputs": {"value": 1}},
        "2": {"class_type": "Sink", "inputs": {"x": ["1", 0]}},
        "3": {"class_type": "NoSuchType", "inputs": {}}}"#;
    let wf = sdkit_schema::workflow::load(unknown, &lib.registry).expect("loads");
    let d = validate_for(&wf, &lib, &StaticOnly, Outputs::Valid).expect_err("refused");
    assert!(d
        .iter()
        .any(|d| d.kind.as_str() == "missing_node_type" && d.is_error()));
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
