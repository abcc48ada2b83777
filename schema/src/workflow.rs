//! The workflow document and the three file forms it is read from.
//!
//! * **Native** (RON or JSON), meant to be written by hand:
//!   ```ron
//!   (nodes: {
//!       "load": LoadImage(image: "photo.png"),
//!       "small": ImageScale(image: ("load", "IMAGE"), upscale_method: "area",
//!                           width: 256, height: 0, crop: "disabled"),
//!       "save": SaveImage(images: ("small", 0), filename_prefix: "small"),
//!   })
//!   ```
//!   In JSON: `{"nodes": {"load": {"type": "LoadImage", "inputs": {...}}}}`.
//!   A two-element list or tuple `(node, output)` is a link; the output is
//!   an index or a name.
//! * **ComfyUI API** (`{"3": {"class_type": "KSampler", "inputs": {...}}}`),
//!   also wrapped as a `/prompt` request body (`{"prompt": {...}}`).
//! * **ComfyUI UI** (a saved workflow with `nodes`, `links` and
//!   `widgets_values`), mapped to inputs through the node specs.
//!
//! Loading checks only the shape of the document; [`crate::Registry`]-level
//! checks (types, ranges, links) are the engine's validation.

use crate::diagnostic::{DiagKind, Diagnostic};
use crate::spec::{NodeSpec, Registry, WidgetSlot};
use crate::syntax::{self, Node, Pos, Value};
use serde_json::{Map, Value as Json};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Which form a workflow was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Native,
    ComfyApi,
    ComfyUi,
}

/// Which output of the source node a link takes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OutputRef {
    Index(usize),
    Name(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    pub node: String,
    pub output: OutputRef,
}

#[derive(Clone, Debug, PartialEq)]
pub enum InputValue {
    /// A widget value as written; the engine coerces it to the declared
    /// type during validation, as ComfyUI does.
    Const(Json),
    Link(Link),
}

#[derive(Clone, Debug, PartialEq)]
pub struct InputDoc {
    pub name: String,
    pub value: InputValue,
    pub pos: Option<Pos>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NodeDoc {
    pub id: String,
    pub class_type: String,
    pub inputs: Vec<InputDoc>,
    pub title: Option<String>,
    pub pos: Option<Pos>,
}

impl NodeDoc {
    pub fn input(&self, name: &str) -> Option<&InputDoc> {
        self.inputs.iter().find(|i| i.name == name)
    }

    pub fn input_mut(&mut self, name: &str) -> Option<&mut InputDoc> {
        self.inputs.iter_mut().find(|i| i.name == name)
    }
}

/// A workflow as read from a file, before validation.
#[derive(Clone, Debug, PartialEq)]
pub struct Workflow {
    pub format: Format,
    /// In file order.
    pub nodes: Vec<NodeDoc>,
    /// The saved UI workflow, kept for the PNG `workflow` text chunk.
    pub ui_workflow: Option<Json>,
    /// Problems that do not stop loading (e.g. unsupported UI features).
    pub warnings: Vec<Diagnostic>,
}

impl Workflow {
    /// Each node's position in [`Workflow::nodes`], by id.
    pub fn index_by_id(&self) -> HashMap<&str, usize> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.id.as_str(), i))
            .collect()
    }

    /// Each node's spec, in node order (`None` for an unknown type).
    pub fn specs<'r>(&self, registry: &'r Registry) -> Vec<Option<&'r NodeSpec>> {
        self.nodes
            .iter()
            .map(|n| registry.get(&n.class_type))
            .collect()
    }

    pub fn node(&self, id: &str) -> Option<&NodeDoc> {
        self.nodes.iter().find(|n| n.id == id)
    }

    pub fn node_mut(&mut self, id: &str) -> Option<&mut NodeDoc> {
        self.nodes.iter_mut().find(|n| n.id == id)
    }

    /// ComfyUI's API form, with links by output index (names resolved
    /// through the registry; unresolvable names are kept as written).
    pub fn to_api_json(&self, registry: &Registry) -> Json {
        let mut out = Map::new();
        for n in &self.nodes {
            let mut inputs = Map::new();
            for i in &n.inputs {
                let v = match &i.value {
                    InputValue::Const(c) => c.clone(),
                    InputValue::Link(l) => {
                        let out = match &l.output {
                            OutputRef::Index(k) => Json::from(*k),
                            OutputRef::Name(name) => self
                                .node(&l.node)
                                .and_then(|src| registry.get(&src.class_type))
                                .and_then(|spec| spec.output_index(name))
                                .map_or_else(|| Json::from(name.clone()), Json::from),
                        };
                        Json::Array(vec![Json::from(l.node.clone()), out])
                    }
                };
                inputs.insert(i.name.clone(), v);
            }
            let mut node = Map::new();
            node.insert("inputs".into(), Json::Object(inputs));
            node.insert("class_type".into(), Json::from(n.class_type.clone()));
            if let Some(t) = &n.title {
                let mut meta = Map::new();
                meta.insert("title".into(), Json::from(t.clone()));
                node.insert("_meta".into(), Json::Object(meta));
            }
            out.insert(n.id.clone(), Json::Object(node));
        }
        Json::Object(out)
    }
}

/// Reads a workflow file's text in any supported form.
///
/// On failure, returns every problem found (at least one).
pub fn load(text: &str, registry: &Registry) -> Result<Workflow, Vec<Diagnostic>> {
    let root = syntax::parse(text)
        .map_err(|e| vec![Diagnostic::error(DiagKind::SyntaxError, e.message).at(Some(e.pos))])?;
    load_tree(&root, registry)
}

/// Reads a workflow from an already-parsed JSON value (HTTP requests).
pub fn load_json(json: &Json, registry: &Registry) -> Result<Workflow, Vec<Diagnostic>> {
    load_tree(&syntax::from_json(json), registry)
}

fn load_tree(root: &Node, registry: &Registry) -> Result<Workflow, Vec<Diagnostic>> {
    let v = &root.value;
    let Some(entries) = v.entries() else {
        return Err(vec![Diagnostic::error(
            DiagKind::InvalidPrompt,
            format!(
                "a workflow is a map of nodes, found a {} (expected native `(nodes: {{...}})`, ComfyUI API or ComfyUI UI form)",
                v.kind()
            ),
        )
        .at(Some(root.pos))]);
    };
    match v.get("nodes").map(|n| &n.value) {
        Some(Value::List(_)) => return load_ui(root, registry),
        Some(nodes @ (Value::Map(_) | Value::Struct { .. })) => {
            return load_native(v.get("nodes").map_or(root.pos, |n| n.pos), nodes)
        }
        _ => {}
    }
    // A `/prompt` request body wraps the API form.
    if let Some(p) = v.get("prompt") {
        if p.value.entries().is_some() {
            return load_api(p);
        }
    }
    let looks_api = !entries.is_empty()
        && entries
            .iter()
            .all(|(_, n)| n.value.get("class_type").is_some() || n.value.get("inputs").is_some());
    if looks_api || entries.is_empty() {
        return load_api(root);
    }
    Err(vec![Diagnostic::error(
        DiagKind::InvalidPrompt,
        "not a workflow: expected a `nodes` map (native), node ids mapping to `class_type`/`inputs` (ComfyUI API), or `nodes`/`links` lists (ComfyUI UI)",
    )
    .at(Some(root.pos))])
}

/// Reads `(node, output)` as a link, if the value has that shape.
fn as_link(v: &Value) -> Option<Link> {
    let items = match v {
        Value::List(items) => items,
        Value::Tuple { name: None, items } => items,
        Value::Tuple {
            name: Some(n),
            items,
        } if n == "Link" => items,
        _ => return None,
    };
    if items.len() != 2 {
        return None;
    }
    let node = match &items[0].value {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => return None,
    };
    let output = match &items[1].value {
        Value::Int(i) => OutputRef::Index(usize::try_from(*i).ok()?),
        Value::Str(s) => OutputRef::Name(s.clone()),
        Value::Ident(s) => OutputRef::Name(s.clone()),
        _ => return None,
    };
    Some(Link { node, output })
}

fn input_value(v: &Node) -> InputValue {
    match as_link(&v.value) {
        Some(l) => InputValue::Link(l),
        None => InputValue::Const(v.value.to_json()),
    }
}

fn load_native(pos: Pos, nodes: &Value) -> Result<Workflow, Vec<Diagnostic>> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let mut seen = HashSet::new();
    for (key, node) in nodes.entries().unwrap_or_default() {
        let id = key.name.clone();
        if !seen.insert(id.clone()) {
            errors.push(
                Diagnostic::error(DiagKind::InvalidPrompt, "duplicate node id")
                    .node(&id, "")
                    .at(Some(key.pos)),
            );
            continue;
        }
        // `Type(input: v, ...)`, `Type()` or `Type` (RON), or
        // `{"type": "...", "inputs": {...}}` (JSON and RON).
        let (class_type, fields, title): (Option<String>, Vec<_>, Option<String>) = match &node
            .value
        {
            Value::Struct {
                name: Some(name),
                fields,
            } => (Some(name.clone()), fields.iter().collect(), None),
            Value::Ident(name) => (Some(name.clone()), Vec::new(), None),
            Value::Map(_) | Value::Struct { name: None, .. } => {
                let ty = node
                    .value
                    .get("type")
                    .or_else(|| node.value.get("class_type"))
                    .and_then(|t| t.value.as_str().map(str::to_string));
                let title = node
                    .value
                    .get("title")
                    .and_then(|t| t.value.as_str().map(str::to_string));
                let fields = match node.value.get("inputs") {
                    Some(inputs) => match inputs.value.entries() {
                        Some(e) => e.iter().collect(),
                        None => {
                            errors.push(
                                Diagnostic::error(
                                    DiagKind::InvalidPrompt,
                                    format!(
                                        "`inputs` must be a map, found a {}",
                                        inputs.value.kind()
                                    ),
                                )
                                .node(&id, ty.as_deref().unwrap_or(""))
                                .at(Some(inputs.pos)),
                            );
                            Vec::new()
                        }
                    },
                    None => Vec::new(),
                };
                (ty, fields, title)
            }
            other => {
                errors.push(
                        Diagnostic::error(
                            DiagKind::InvalidPrompt,
                            format!(
                                "a node is `Type(input: value, ...)` or {{\"type\": ..., \"inputs\": ...}}, found a {}",
                                other.kind()
                            ),
                        )
                        .node(&id, "")
                        .at(Some(node.pos)),
                    );
                continue;
            }
        };
        let Some(class_type) = class_type else {
            errors.push(
                Diagnostic::error(DiagKind::InvalidPrompt, "node has no `type`")
                    .node(&id, "")
                    .at(Some(node.pos)),
            );
            continue;
        };
        let mut inputs = Vec::new();
        let mut names = HashSet::new();
        for (k, v) in fields {
            if !names.insert(k.name.clone()) {
                errors.push(
                    Diagnostic::error(DiagKind::InvalidPrompt, "input given twice")
                        .node(&id, &class_type)
                        .input(&k.name)
                        .at(Some(k.pos)),
                );
                continue;
            }
            inputs.push(InputDoc {
                name: k.name.clone(),
                value: input_value(v),
                pos: Some(k.pos),
            });
        }
        out.push(NodeDoc {
            id,
            class_type,
            inputs,
            title,
            pos: Some(key.pos),
        });
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let _ = pos;
    Ok(Workflow {
        format: Format::Native,
        nodes: out,
        ui_workflow: None,
        warnings: Vec::new(),
    })
}

fn load_api(root: &Node) -> Result<Workflow, Vec<Diagnostic>> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (key, node) in root.value.entries().unwrap_or_default() {
        let id = key.name.clone();
        let Some(ct) = node.value.get("class_type") else {
            errors.push(
                Diagnostic::error(
                    DiagKind::InvalidPrompt,
                    "Cannot execute because a node is missing the class_type property.",
                )
                .node(&id, "")
                .at(Some(node.pos)),
            );
            continue;
        };
        let Some(class_type) = ct.value.as_str().map(str::to_string) else {
            errors.push(
                Diagnostic::error(DiagKind::InvalidPrompt, "class_type must be a string")
                    .node(&id, "")
                    .at(Some(ct.pos)),
            );
            continue;
        };
        let title = node
            .value
            .get("_meta")
            .and_then(|m| m.value.get("title"))
            .and_then(|t| t.value.as_str().map(str::to_string));
        let mut inputs = Vec::new();
        if let Some(ins) = node.value.get("inputs") {
            match ins.value.entries() {
                Some(entries) => {
                    for (k, v) in entries {
                        // ComfyUI wraps list-valued widgets as
                        // {"__value__": [...]} so they are not read as links.
                        let value = match v.value.get("__value__") {
                            Some(inner) => InputValue::Const(inner.value.to_json()),
                            None => input_value(v),
                        };
                        inputs.push(InputDoc {
                            name: k.name.clone(),
                            value,
                            pos: Some(k.pos),
                        });
                    }
                }
                None => errors.push(
                    Diagnostic::error(DiagKind::InvalidPrompt, "`inputs` must be a map")
                        .node(&id, &class_type)
                        .at(Some(ins.pos)),
                ),
            }
        }
        out.push(NodeDoc {
            id,
            class_type,
            inputs,
            title,
            pos: Some(key.pos),
        });
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(Workflow {
        format: Format::ComfyApi,
        nodes: out,
        ui_workflow: None,
        warnings: Vec::new(),
    })
}

/// UI-only node types that never execute.
const UI_ONLY: &[&str] = &["Note", "MarkdownNote", "PrimitiveNode", "Reroute"];

/// One UI-format link: origin node and slot.
#[derive(Clone, Copy)]
struct UiLink {
    origin: i128,
    slot: usize,
}

struct UiNode<'a> {
    id: i128,
    ty: String,
    mode: i128,
    node: &'a Node,
    /// (input name, link id, input type)
    inputs: Vec<(String, Option<i128>, String)>,
}

fn int_of(v: Option<&Node>) -> Option<i128> {
    match v.map(|n| &n.value) {
        Some(Value::Int(i)) => Some(*i),
        Some(Value::Float(f)) if f.fract() == 0.0 => Some(*f as i128),
        Some(Value::Str(s)) => s.parse().ok(),
        _ => None,
    }
}

fn load_ui(root: &Node, registry: &Registry) -> Result<Workflow, Vec<Diagnostic>> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let nodes_v = match root.value.get("nodes").map(|n| &n.value) {
        Some(Value::List(items)) => items.as_slice(),
        _ => &[],
    };
    // Links: [id, origin_id, origin_slot, target_id, target_slot, type]
    // (format 0.4) or objects with the same field names (format 1).
    let mut links: HashMap<i128, UiLink> = HashMap::new();
    if let Some(Value::List(items)) = root.value.get("links").map(|n| &n.value) {
        for l in items {
            let parsed = match &l.value {
                Value::List(f) if f.len() >= 3 => int_of(f.first())
                    .zip(int_of(f.get(1)))
                    .zip(int_of(f.get(2))),
                Value::Map(_) => int_of(l.value.get("id"))
                    .zip(int_of(l.value.get("origin_id")))
                    .zip(int_of(l.value.get("origin_slot"))),
                _ => None,
            };
            match parsed {
                Some(((id, origin), slot)) if slot >= 0 => {
                    links.insert(
                        id,
                        UiLink {
                            origin,
                            slot: slot as usize,
                        },
                    );
                }
                _ => errors.push(
                    Diagnostic::error(DiagKind::InvalidPrompt, "malformed link entry")
                        .at(Some(l.pos)),
                ),
            }
        }
    }
    let mut ui_nodes: BTreeMap<i128, UiNode> = BTreeMap::new();
    for n in nodes_v {
        let Some(id) = int_of(n.value.get("id")) else {
            errors.push(
                Diagnostic::error(DiagKind::InvalidPrompt, "UI node without an integer `id`")
                    .at(Some(n.pos)),
            );
            continue;
        };
        let Some(ty) = n.value.get("type").and_then(|t| t.value.as_str()) else {
            errors.push(
                Diagnostic::error(DiagKind::InvalidPrompt, "UI node without a `type`")
                    .node(&id.to_string(), "")
                    .at(Some(n.pos)),
            );
            continue;
        };
        let mut inputs = Vec::new();
        if let Some(Value::List(ins)) = n.value.get("inputs").map(|v| &v.value) {
            for i in ins {
                let name = i
                    .value
                    .get("name")
                    .and_then(|v| v.value.as_str())
                    .unwrap_or("")
                    .to_string();
                let itype = i
                    .value
                    .get("type")
                    .and_then(|v| v.value.as_str())
                    .unwrap_or("")
                    .to_string();
                inputs.push((name, int_of(i.value.get("link")), itype));
            }
        }
        ui_nodes.insert(
            id,
            UiNode {
                id,
                ty: ty.to_string(),
                mode: int_of(n.value.get("mode")).unwrap_or(0),
                node: n,
                inputs,
            },
        );
    }

    // Follows a link through Reroutes and bypassed nodes to the node that
    // really produces the value. None: the link carries no value (muted
    // source, primitive widget, dangling).
    fn resolve(
        link_id: i128,
        links: &HashMap<i128, UiLink>,
        nodes: &BTreeMap<i128, UiNode>,
        depth: usize,
    ) -> Option<(i128, usize)> {
        if depth > 256 {
            return None;
        }
        let l = links.get(&link_id)?;
        let src = nodes.get(&l.origin)?;
        match (src.ty.as_str(), src.mode) {
            ("Reroute", _) => {
                let up = src.inputs.first()?.1?;
                resolve(up, links, nodes, depth + 1)
            }
            ("PrimitiveNode", _) => None,
            (_, 2) => None,
            (_, 4) => {
                // A bypassed node passes through the first input whose type
                // matches the output's type, preferring the same slot.
                let out_ty = src
                    .node
                    .value
                    .get("outputs")
                    .and_then(|o| match &o.value {
                        Value::List(items) => items.get(l.slot),
                        _ => None,
                    })
                    .and_then(|o| o.value.get("type"))
                    .and_then(|t| t.value.as_str())
                    .unwrap_or("")
                    .to_string();
                let candidate = src
                    .inputs
                    .get(l.slot)
                    .filter(|i| i.2 == out_ty && i.1.is_some())
                    .or_else(|| src.inputs.iter().find(|i| i.2 == out_ty && i.1.is_some()))?;
                resolve(candidate.1?, links, nodes, depth + 1)
            }
            _ => Some((src.id, l.slot)),
        }
    }

    let mut out = Vec::new();
    for un in ui_nodes.values() {
        if UI_ONLY.contains(&un.ty.as_str()) || un.mode == 2 || un.mode == 4 {
            continue;
        }
        let id = un.id.to_string();
        let title = un
            .node
            .value
            .get("title")
            .and_then(|t| t.value.as_str().map(str::to_string));
        let mut inputs = Vec::new();
        let mut linked = HashSet::new();
        for (name, link, _) in &un.inputs {
            let Some(link) = link else { continue };
            if let Some((src, slot)) = resolve(*link, &links, &ui_nodes, 0) {
                linked.insert(name.clone());
                inputs.push(InputDoc {
                    name: name.clone(),
                    value: InputValue::Link(Link {
                        node: src.to_string(),
                        output: OutputRef::Index(slot),
                    }),
                    pos: Some(un.node.pos),
                });
            }
        }
        let Some(spec) = registry.get(&un.ty) else {
            // Unknown types still come through so validation reports them
            // with the rest.
            out.push(NodeDoc {
                id,
                class_type: un.ty.clone(),
                inputs,
                title,
                pos: Some(un.node.pos),
            });
            continue;
        };
        match un.node.value.get("widgets_values").map(|w| &w.value) {
            Some(Value::List(values)) => {
                let slots = spec.widget_slots();
                let mut vi = 0;
                for slot in &slots {
                    match slot {
                        WidgetSlot::Input(input) => {
                            if let Some(v) = values.get(vi) {
                                if !linked.contains(&input.name) {
                                    inputs.push(InputDoc {
                                        name: input.name.clone(),
                                        value: InputValue::Const(v.value.to_json()),
                                        pos: Some(v.pos),
                                    });
                                }
                            }
                            vi += 1;
                        }
                        WidgetSlot::ControlAfterGenerate => {
                            // Only skip it when the saved value is one of
                            // the control words; older files omit it.
                            if let Some(Value::Str(s)) = values.get(vi).map(|v| &v.value) {
                                if ["fixed", "increment", "decrement", "randomize"]
                                    .contains(&s.as_str())
                                {
                                    vi += 1;
                                }
                            }
                        }
                        WidgetSlot::Upload => {
                            if let Some(Value::Str(s)) = values.get(vi).map(|v| &v.value) {
                                if s == "image" {
                                    vi += 1;
                                }
                            }
                        }
                    }
                }
            }
            Some(Value::Map(entries)) => {
                for (k, v) in entries {
                    if spec.input(&k.name).is_some() && !linked.contains(&k.name) {
                        inputs.push(InputDoc {
                            name: k.name.clone(),
                            value: InputValue::Const(v.value.to_json()),
                            pos: Some(v.pos),
                        });
                    }
                }
            }
            _ => {}
        }
        out.push(NodeDoc {
            id,
            class_type: un.ty.clone(),
            inputs,
            title,
            pos: Some(un.node.pos),
        });
    }
    if root
        .value
        .get("definitions")
        .and_then(|d| d.value.get("subgraphs"))
        .is_some()
    {
        warnings.push(Diagnostic::warning(
            DiagKind::InvalidPrompt,
            "this UI workflow uses subgraphs, which are not supported yet; export it in API format instead",
        ));
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(Workflow {
        format: Format::ComfyUi,
        nodes: out,
        ui_workflow: Some(root.value.to_json()),
        warnings,
    })
}

/// Reads one input value written on a command line (`--set`): RON/JSON
/// syntax when it parses (`12`, `"text"`, `("4", 0)` as a link), else the
/// raw text as a string.
pub fn parse_input_value(text: &str) -> InputValue {
    match syntax::parse(text) {
        Ok(node) => input_value(&node),
        Err(_) => InputValue::Const(Json::String(text.to_string())),
    }
}
