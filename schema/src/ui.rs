//! A workflow in ComfyUI's UI form: what the front end loads (templates,
//! dropped files) and lays out, written from any form sdkit reads.
//!
//! The inverse of the UI loader in [`crate::workflow`]: node ids become
//! integers, links a `links` table, constants `widgets_values` in
//! [`NodeSpec::widget_slots`] order (the seed's "control after generate"
//! as `fixed`, so a template reproduces its image). Nodes are laid out in
//! columns by their distance from the workflow's sources.

use crate::spec::{ComboOptions, InputKind, Registry, WidgetSlot};
use crate::workflow::{InputValue, OutputRef, Workflow};
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;

/// Horizontal distance between columns of nodes.
const COLUMN: i64 = 380;
/// Width the front end gives most nodes.
const WIDTH: i64 = 320;

/// The workflow in ComfyUI's UI form (format 0.4). A workflow read from
/// the UI form comes back as it was saved.
pub fn to_ui_json(wf: &Workflow, registry: &Registry) -> Json {
    if let Some(ui) = &wf.ui_workflow {
        return ui.clone();
    }
    let ids = numeric_ids(wf);
    let index = wf.index_by_id();
    let specs = wf.specs(registry);

    // Links first: each node's `inputs` and `outputs` list theirs.
    let mut links = Vec::new();
    // (node, input name) → link id; (node, output slot) → link ids.
    let mut link_in: HashMap<(usize, &str), i64> = HashMap::new();
    let mut link_out: HashMap<(usize, usize), Vec<i64>> = HashMap::new();
    // Each node's column: one past its furthest source.
    let mut depth = vec![0usize; wf.nodes.len()];
    for (to, n) in wf.nodes.iter().enumerate() {
        for input in &n.inputs {
            let InputValue::Link(l) = &input.value else {
                continue;
            };
            let Some(&from) = index.get(l.node.as_str()) else {
                continue;
            };
            let slot = match &l.output {
                OutputRef::Index(k) => Some(*k),
                OutputRef::Name(name) => specs[from].and_then(|s| s.output_index(name)),
            };
            let Some(slot) = slot else { continue };
            let ty = specs[from]
                .and_then(|s| s.outputs.get(slot))
                .map_or("*".to_string(), |o| o.ty.name().to_string());
            let id = links.len() as i64 + 1;
            // The target slot is filled in when the target's inputs are
            // listed; links are written after that.
            links.push((id, ids[from], slot, ids[to], ty));
            link_in.insert((to, input.name.as_str()), id);
            link_out.entry((from, slot)).or_default().push(id);
        }
    }
    // Longest path from a source; a cycle (refused by validation anyway)
    // stops growing after as many rounds as there are nodes.
    for _ in 0..wf.nodes.len() {
        let mut changed = false;
        for (to, n) in wf.nodes.iter().enumerate() {
            for input in &n.inputs {
                if let InputValue::Link(l) = &input.value {
                    if let Some(&from) = index.get(l.node.as_str()) {
                        if depth[to] <= depth[from] {
                            depth[to] = depth[from] + 1;
                            changed = true;
                        }
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }

    let mut target_slot: HashMap<i64, usize> = HashMap::new();
    let mut column_y: HashMap<usize, i64> = HashMap::new();
    let mut order: Vec<usize> = (0..wf.nodes.len()).collect();
    order.sort_by_key(|&i| depth[i]);
    let mut nodes = Vec::new();
    for (rank, &i) in order.iter().enumerate() {
        let n = &wf.nodes[i];
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        let mut widgets = Vec::new();
        let constant = |name: &str| {
            n.input(name).and_then(|d| match &d.value {
                InputValue::Const(c) => Some(c.clone()),
                InputValue::Link(_) => None,
            })
        };
        let mut socket = |name: &str, ty: &str, widget: bool, inputs: &mut Vec<Json>| {
            let link = link_in.get(&(i, name)).copied();
            if widget && link.is_none() {
                return;
            }
            if let Some(id) = link {
                target_slot.insert(id, inputs.len());
            }
            let mut entry = json!({"name": name, "type": ty, "link": link});
            if widget {
                entry["widget"] = json!({ "name": name });
            }
            inputs.push(entry);
        };
        match specs[i] {
            Some(spec) => {
                for input in &spec.inputs {
                    let ty = input.kind.socket_type();
                    socket(&input.name, ty.name(), input.kind.is_widget(), &mut inputs);
                }
                for slot in spec.widget_slots() {
                    widgets.push(match slot {
                        WidgetSlot::Input(input) => {
                            constant(&input.name).unwrap_or_else(|| default_value(&input.kind))
                        }
                        WidgetSlot::ControlAfterGenerate => json!("fixed"),
                        WidgetSlot::Upload => json!("image"),
                    });
                }
                for (k, o) in spec.outputs.iter().enumerate() {
                    outputs.push(json!({
                        "name": o.name,
                        "type": o.ty.name(),
                        "links": link_out.get(&(i, k)),
                        "slot_index": k,
                    }));
                }
            }
            // An unknown type keeps its links and constants, in file order.
            None => {
                for d in &n.inputs {
                    match &d.value {
                        InputValue::Link(_) => socket(&d.name, "*", false, &mut inputs),
                        InputValue::Const(c) => widgets.push(c.clone()),
                    }
                }
            }
        }
        // Roughly the front end's own sizing: a title, then a row per
        // socket pair and per widget (multiline text is taller).
        let rows = inputs.len().max(outputs.len()) + widgets.len();
        let tall = specs[i].is_some_and(|s| {
            s.inputs.iter().any(|x| {
                matches!(
                    x.kind,
                    InputKind::String {
                        multiline: true,
                        ..
                    }
                )
            })
        });
        let height = 30 + 24 * rows as i64 + if tall { 120 } else { 0 };
        let y = column_y.entry(depth[i]).or_insert(60);
        let mut node = Map::new();
        node.insert("id".into(), json!(ids[i]));
        node.insert("type".into(), json!(n.class_type));
        node.insert("pos".into(), json!([40 + COLUMN * depth[i] as i64, *y]));
        node.insert("size".into(), json!([WIDTH, height]));
        node.insert("flags".into(), json!({}));
        node.insert("order".into(), json!(rank));
        node.insert("mode".into(), json!(0));
        node.insert("inputs".into(), Json::Array(inputs));
        node.insert("outputs".into(), Json::Array(outputs));
        node.insert(
            "properties".into(),
            json!({"Node name for S&R": n.class_type}),
        );
        node.insert("widgets_values".into(), Json::Array(widgets));
        if let Some(t) = &n.title {
            node.insert("title".into(), json!(t));
        }
        *y += height + 50;
        nodes.push(Json::Object(node));
    }
    let links: Vec<Json> = links
        .into_iter()
        .map(|(id, from, from_slot, to, ty)| {
            json!([
                id,
                from,
                from_slot,
                to,
                target_slot.get(&id).copied().unwrap_or(0),
                ty
            ])
        })
        .collect();
    json!({
        "last_node_id": ids.iter().copied().max().unwrap_or(0),
        "last_link_id": links.len(),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {},
        "version": 0.4,
    })
}

/// Integer ids: the workflow's own where all are distinct positive
/// integers (API files), else 1, 2, … in file order.
fn numeric_ids(wf: &Workflow) -> Vec<i64> {
    let own: Vec<Option<i64>> = wf
        .nodes
        .iter()
        .map(|n| n.id.parse::<i64>().ok().filter(|&i| i > 0))
        .collect();
    let mut distinct: Vec<i64> = own.iter().flatten().copied().collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() == wf.nodes.len() {
        own.into_iter().flatten().collect()
    } else {
        (1..=wf.nodes.len() as i64).collect()
    }
}

/// A widget's value when the workflow gives none (or links it).
fn default_value(kind: &InputKind) -> Json {
    match kind {
        InputKind::Int { default, .. } => {
            i64::try_from(*default).map_or_else(|_| json!(default.to_string()), |v| json!(v))
        }
        InputKind::Float { default, .. } => json!(default),
        InputKind::String { default, .. } => json!(default),
        InputKind::Boolean { default } => json!(default),
        // Without a declared default a combo starts at its first option,
        // as ComfyUI's front end does.
        InputKind::Combo {
            default, options, ..
        } => json!(default.clone().unwrap_or_else(|| match options {
            ComboOptions::Static(v) => v.first().cloned().unwrap_or_default(),
            _ => String::new(),
        })),
        InputKind::Socket(_) => Json::Null,
    }
}
