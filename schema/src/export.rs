//! Exports of the registry: ComfyUI's `/object_info` and a JSON Schema for
//! the native workflow format.

use crate::spec::{ComboOptions, Hidden, InputKind, InputSpec, NodeSpec, Registry};
use crate::syntax::int_to_json;
use serde_json::{json, Map, Value as Json};

/// Resolves combos whose options depend on the machine (model and input
/// folders). The schema crate does no I/O, so the caller supplies this.
pub trait ComboSource {
    fn options(&self, options: &ComboOptions) -> Vec<String>;

    /// Whether `value` is acceptable; by default, whether it is listed.
    fn contains(&self, options: &ComboOptions, value: &str) -> bool {
        self.options(options).iter().any(|o| o == value)
    }

    /// What to add when a value is not among `options`, for options read
    /// from a folder: where the files were looked for and where to put
    /// one. None by default.
    fn missing_hint(&self, _options: &ComboOptions) -> Option<String> {
        None
    }
}

/// Knows only static options; folder-backed combos list nothing.
pub struct StaticOnly;

impl ComboSource for StaticOnly {
    fn options(&self, options: &ComboOptions) -> Vec<String> {
        match options {
            ComboOptions::Static(v) => v.clone(),
            _ => Vec::new(),
        }
    }
}

fn float_json(x: f64) -> Json {
    serde_json::Number::from_f64(x).map_or(Json::Null, Json::Number)
}

/// One input in ComfyUI's `[TYPE, {options}]` form.
fn input_info(input: &InputSpec, combos: &dyn ComboSource) -> Json {
    let mut opts = Map::new();
    if let Some(t) = &input.tooltip {
        opts.insert("tooltip".into(), json!(t));
    }
    let ty = match &input.kind {
        InputKind::Socket(t) => json!(t.name()),
        InputKind::Int {
            default,
            min,
            max,
            step,
            control_after_generate,
        } => {
            opts.insert("default".into(), int_to_json(*default));
            opts.insert("min".into(), int_to_json(*min));
            opts.insert("max".into(), int_to_json(*max));
            opts.insert("step".into(), int_to_json(*step));
            if *control_after_generate {
                opts.insert("control_after_generate".into(), json!(true));
            }
            json!("INT")
        }
        InputKind::Float {
            default,
            min,
            max,
            step,
            round,
        } => {
            opts.insert("default".into(), float_json(*default));
            opts.insert("min".into(), float_json(*min));
            opts.insert("max".into(), float_json(*max));
            opts.insert("step".into(), float_json(*step));
            if let Some(r) = round {
                opts.insert("round".into(), float_json(*r));
            }
            json!("FLOAT")
        }
        InputKind::String {
            default,
            multiline,
            dynamic_prompts,
        } => {
            opts.insert("default".into(), json!(default));
            if *multiline {
                opts.insert("multiline".into(), json!(true));
            }
            if *dynamic_prompts {
                opts.insert("dynamicPrompts".into(), json!(true));
            }
            json!("STRING")
        }
        InputKind::Boolean { default } => {
            opts.insert("default".into(), json!(default));
            json!("BOOLEAN")
        }
        InputKind::Combo {
            options,
            default,
            image_upload,
        } => {
            if let Some(d) = default {
                opts.insert("default".into(), json!(d));
            }
            if *image_upload {
                opts.insert("image_upload".into(), json!(true));
            }
            Json::Array(
                combos
                    .options(options)
                    .into_iter()
                    .map(Json::from)
                    .collect(),
            )
        }
    };
    if opts.is_empty() && matches!(input.kind, InputKind::Socket(_)) {
        json!([ty])
    } else {
        json!([ty, Json::Object(opts)])
    }
}

/// One node type in ComfyUI's `/object_info` shape.
pub fn node_info(spec: &NodeSpec, combos: &dyn ComboSource) -> Json {
    let mut required = Map::new();
    let mut optional = Map::new();
    let mut req_order = Vec::new();
    let mut opt_order = Vec::new();
    for i in &spec.inputs {
        let info = input_info(i, combos);
        if i.required {
            required.insert(i.name.clone(), info);
            req_order.push(json!(i.name));
        } else {
            optional.insert(i.name.clone(), info);
            opt_order.push(json!(i.name));
        }
    }
    let mut input = Map::new();
    input.insert("required".into(), Json::Object(required));
    if !optional.is_empty() {
        input.insert("optional".into(), Json::Object(optional));
    }
    if !spec.hidden.is_empty() {
        let hidden: Map<String, Json> = spec
            .hidden
            .iter()
            .map(|h| match h {
                Hidden::Prompt => ("prompt".to_string(), json!("PROMPT")),
                Hidden::ExtraPngInfo => ("extra_pnginfo".to_string(), json!("EXTRA_PNGINFO")),
                Hidden::UniqueId => ("unique_id".to_string(), json!("UNIQUE_ID")),
            })
            .collect();
        input.insert("hidden".into(), Json::Object(hidden));
    }
    let mut order = Map::new();
    order.insert("required".into(), Json::Array(req_order));
    if !opt_order.is_empty() {
        order.insert("optional".into(), Json::Array(opt_order));
    }
    let mut o = Map::new();
    o.insert("input".into(), Json::Object(input));
    o.insert("input_order".into(), Json::Object(order));
    o.insert(
        "output".into(),
        spec.outputs.iter().map(|x| json!(x.ty.name())).collect(),
    );
    o.insert(
        "output_is_list".into(),
        spec.outputs.iter().map(|x| json!(x.is_list)).collect(),
    );
    o.insert(
        "output_name".into(),
        spec.outputs.iter().map(|x| json!(x.name)).collect(),
    );
    if spec.outputs.iter().any(|x| x.tooltip.is_some()) {
        o.insert(
            "output_tooltips".into(),
            spec.outputs
                .iter()
                .map(|x| json!(x.tooltip.clone().unwrap_or_default()))
                .collect(),
        );
    }
    o.insert("name".into(), json!(spec.name));
    o.insert("display_name".into(), json!(spec.display_name));
    o.insert("description".into(), json!(spec.description));
    o.insert("python_module".into(), json!("nodes"));
    o.insert("category".into(), json!(spec.category));
    o.insert("output_node".into(), json!(spec.output_node));
    if spec.deprecated {
        o.insert("deprecated".into(), json!(true));
    }
    if spec.experimental {
        o.insert("experimental".into(), json!(true));
    }
    Json::Object(o)
}

/// Every node type, keyed by name, as ComfyUI's `GET /object_info` returns.
pub fn object_info(registry: &Registry, combos: &dyn ComboSource) -> Json {
    Json::Object(
        registry
            .iter()
            .map(|s| (s.name.clone(), node_info(s, combos)))
            .collect(),
    )
}

fn input_schema(input: &InputSpec, combos: &dyn ComboSource) -> Json {
    let link = json!({"$ref": "#/definitions/link"});
    let mut constant = match &input.kind {
        InputKind::Socket(t) => {
            let mut l = json!({"$ref": "#/definitions/link"});
            if let Some(m) = l.as_object_mut() {
                m.insert("description".into(), json!(format!("link to a {t} output")));
            }
            return l;
        }
        InputKind::Int {
            default, min, max, ..
        } => json!({"type": "integer", "default": int_to_json(*default),
                    "minimum": int_to_json(*min), "maximum": int_to_json(*max)}),
        InputKind::Float {
            default, min, max, ..
        } => json!({"type": "number", "default": float_json(*default),
                    "minimum": float_json(*min), "maximum": float_json(*max)}),
        InputKind::String { default, .. } => json!({"type": "string", "default": default}),
        InputKind::Boolean { default } => json!({"type": "boolean", "default": default}),
        InputKind::Combo { options, .. } => {
            let opts = combos.options(options);
            if matches!(options, ComboOptions::Static(_)) {
                json!({"type": "string", "enum": opts})
            } else {
                // Folder contents change; list what is there now as
                // suggestions without rejecting other names.
                json!({"type": "string", "examples": opts})
            }
        }
    };
    if let (Some(m), Some(t)) = (constant.as_object_mut(), &input.tooltip) {
        m.insert("description".into(), json!(t));
    }
    json!({"anyOf": [constant, link]})
}

/// A JSON Schema (draft-07) for the native workflow format in JSON, for
/// editor completion and checking.
pub fn workflow_json_schema(registry: &Registry, combos: &dyn ComboSource) -> Json {
    let variants: Vec<Json> = registry
        .iter()
        .map(|spec| {
            let props: Map<String, Json> = spec
                .inputs
                .iter()
                .map(|i| (i.name.clone(), input_schema(i, combos)))
                .collect();
            let required: Vec<Json> = spec
                .inputs
                .iter()
                .filter(|i| i.required)
                .map(|i| json!(i.name))
                .collect();
            json!({
                "type": "object",
                "description": if spec.description.is_empty() { spec.display_name.clone() } else { spec.description.clone() },
                "required": ["type"],
                "properties": {
                    "type": {"const": spec.name},
                    "title": {"type": "string"},
                    "inputs": {
                        "type": "object",
                        "properties": props,
                        "required": required,
                        "additionalProperties": false,
                    },
                },
                "additionalProperties": false,
            })
        })
        .collect();
    let names: Vec<Json> = registry.iter().map(|s| json!(s.name)).collect();
    json!({
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "sdkit workflow",
        "description": "A node graph: node ids map to a node type and its inputs. An input is a constant or a link [node_id, output] where output is an index or an output name.",
        "type": "object",
        "required": ["nodes"],
        "properties": {
            "nodes": {
                "type": "object",
                "additionalProperties": {"$ref": "#/definitions/node"},
            },
        },
        "definitions": {
            "link": {
                "type": "array",
                "items": [{"type": "string"}, {"type": ["integer", "string"]}],
                "minItems": 2,
                "maxItems": 2,
            },
            "node_type": {"enum": names},
            "node": {
                "allOf": [
                    {"type": "object", "properties": {"type": {"$ref": "#/definitions/node_type"}}},
                    {"oneOf": variants},
                ],
            },
        },
    })
}
