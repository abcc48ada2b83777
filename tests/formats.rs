//! The native RON and JSON forms, ComfyUI's API form and ComfyUI's UI form
//! of the same workflow validate to the same graph.

use sdkit_engine::graph::canonical;
use sdkit_engine::validate;
use sdkit_schema::export::StaticOnly;
use sdkit_schema::workflow::{load, Format};
use std::path::PathBuf;

fn graph_of(file: &str) -> (Format, Vec<sdkit_engine::graph::CanonicalNode>) {
    let lib = sdkit_nodes::library();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).expect("read");
    let wf = load(&text, &lib.registry).expect("loads");
    // Input files are not checked here: the combo source lists none.
    let paths =
        sdkit_engine::Paths::under(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs"));
    let paths = sdkit_engine::Paths {
        input: paths.input.clone(),
        ..paths
    };
    let g = validate(&wf, &lib.registry, &paths).unwrap_or_else(|d| panic!("{file}: {d:?}"));
    let _ = StaticOnly;
    (wf.format, canonical(&g))
}

#[test]
fn four_forms_one_graph() {
    let (f1, ron) = graph_of("graphs/image_pipeline.ron");
    let (f2, json) = graph_of("graphs/image_pipeline.json");
    let (f3, api) = graph_of("graphs/comfy_api_image_pipeline.json");
    let (f4, ui) = graph_of("graphs/comfy_ui_image_pipeline.json");
    assert_eq!(
        (f1, f2, f3, f4),
        (
            Format::Native,
            Format::Native,
            Format::ComfyApi,
            Format::ComfyUi
        )
    );
    assert_eq!(ron, json);
    assert_eq!(ron, api);
    // The UI form numbers its nodes; map them to the native ids.
    let rename = |s: &str| match s {
        "1" => "load",
        "2" => "scale",
        "3" => "invert",
        "4" => "save",
        other => panic!("unexpected node {other}"),
    };
    let ui: Vec<_> = ui
        .into_iter()
        .map(|(id, ty, inputs)| {
            let inputs = inputs
                .into_iter()
                .map(|(n, v)| {
                    let v = match v.strip_prefix("link(") {
                        Some(rest) => {
                            let (node, tail) = rest.split_once(',').expect("link");
                            format!("link({},{tail}", rename(node))
                        }
                        None => v,
                    };
                    (n, v)
                })
                .collect();
            (rename(&id).to_string(), ty, inputs)
        })
        .collect();
    let mut ui = ui;
    ui.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(ron, ui);
}

/// Accepts every combo value: the model files the examples name are not
/// here, and the round trip below is about structure.
struct AnyValue;

impl sdkit_schema::export::ComboSource for AnyValue {
    fn options(&self, _: &sdkit_schema::spec::ComboOptions) -> Vec<String> {
        Vec::new()
    }
    fn contains(&self, _: &sdkit_schema::spec::ComboOptions, _: &str) -> bool {
        true
    }
}

/// Every example workflow, written in the UI form (what the server serves
/// as a template) and read back, validates to the same graph.
#[test]
fn every_example_survives_the_ui_form() {
    let lib = sdkit_nodes::library();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs");
    let mut checked = 0;
    for e in std::fs::read_dir(&dir).expect("graphs/") {
        let path = e.expect("entry").path();
        if !path.extension().is_some_and(|x| x == "ron" || x == "json") {
            continue;
        }
        let name = path.display().to_string();
        let wf = load(
            &std::fs::read_to_string(&path).expect("read"),
            &lib.registry,
        )
        .unwrap_or_else(|d| panic!("{name}: {d:?}"));
        let want = canonical(&validate(&wf, &lib.registry, &AnyValue).expect("valid"));
        let ui = sdkit_schema::ui::to_ui_json(&wf, &lib.registry);
        let back = sdkit_schema::workflow::load_json(&ui, &lib.registry)
            .unwrap_or_else(|d| panic!("{name}: {d:?}"));
        assert_eq!(back.format, Format::ComfyUi);
        let got = canonical(&validate(&back, &lib.registry, &AnyValue).expect("valid"));
        // The UI form numbers nodes 1, 2, ... in file order unless the ids
        // already are distinct positive integers.
        let numeric = wf
            .nodes
            .iter()
            .all(|n| n.id.parse::<u32>().is_ok_and(|i| i > 0));
        let rename = |id: &str| -> String {
            match id.parse::<usize>() {
                Ok(i) if !numeric => wf.nodes[i - 1].id.clone(),
                _ => id.to_string(),
            }
        };
        let mut got: Vec<_> = got
            .into_iter()
            .map(|(id, ty, inputs)| {
                let inputs = inputs
                    .into_iter()
                    .map(|(n, v)| match v.strip_prefix("link(") {
                        Some(rest) => {
                            let (node, tail) = rest.split_once(',').expect("link");
                            (n, format!("link({},{tail}", rename(node)))
                        }
                        None => (n, v),
                    })
                    .collect();
                (rename(&id), ty, inputs)
            })
            .collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want, "{name}");
        checked += 1;
    }
    assert!(checked >= 15);
}
