//! The readers never panic, always explain failures, and agree with serde.

use proptest::prelude::*;
use sdkit_schema::spec::node;
use sdkit_schema::syntax;
use sdkit_schema::workflow::{load, Format};
use sdkit_schema::{Registry, SocketType};

fn registry() -> Registry {
    let mut r = Registry::new();
    r.insert(
        node("Thing", "test")
            .int("n", 1, 0, 10, 1)
            .optional_socket("x", SocketType::Image)
            .returns(SocketType::Image)
            .build(),
    );
    r
}

const VALID_RON: &str = r#"// a comment
(nodes: {
    "a": Thing(n: 3),
    "b": Thing(n: 4, x: ("a", "IMAGE")), /* trailing */
})"#;

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        (-1e12f64..1e12).prop_map(serde_json::Value::from),
        ".*".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map("[a-z\"\\\\é ]{0,6}", inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = syntax::parse(&text);
        if let Err(d) = load(&text, &registry()) {
            prop_assert!(!d.is_empty());
        }
    }

    #[test]
    fn mutated_workflows_never_panic(at in 0usize..VALID_RON.len(), del in 0usize..8, ins in "[(){}\\[\\]\",:a-z0-9 ]{0,4}") {
        let mut s: Vec<char> = VALID_RON.chars().collect();
        let at = at.min(s.len());
        let end = (at + del).min(s.len());
        s.splice(at..end, ins.chars());
        let text: String = s.into_iter().collect();
        if let Err(d) = load(&text, &registry()) {
            prop_assert!(!d.is_empty());
            for x in &d {
                prop_assert!(x.line.is_none() || x.line.unwrap_or(0) >= 1);
            }
        }
    }

    #[test]
    fn json_round_trips(v in json_value()) {
        let text = serde_json::to_string_pretty(&v).expect("serialises");
        let parsed = syntax::parse(&text).expect("parses serde's JSON");
        let back = parsed.value.to_json();
        // Floats may print differently but must read back to the same value.
        prop_assert_eq!(serde_json::to_string(&back).ok(), serde_json::to_string(&v).ok());
    }
}

#[test]
fn ron_native_loads_with_positions() {
    let wf = load(VALID_RON, &registry()).expect("loads");
    assert_eq!(wf.format, Format::Native);
    assert_eq!(wf.nodes.len(), 2);
    let b = &wf.nodes[1];
    assert_eq!(b.pos.map(|p| (p.line, p.col)), Some((4, 5)));
    let x = b.input("x").expect("x");
    assert_eq!(x.pos.map(|p| (p.line, p.col)), Some((4, 22)));
}

#[test]
fn syntax_errors_point_at_the_problem() {
    let d = load("(nodes: {\n  \"a\": Thing(n: 3,, ),\n})", &registry()).expect_err("bad");
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].kind.as_str(), "syntax_error");
    assert_eq!((d[0].line, d[0].column), (Some(2), Some(19)));
}
