//! Node type specifications: sockets, widgets, outputs.
//!
//! A [`NodeSpec`] is plain data. It says what a node type accepts and returns,
//! with ComfyUI's names, defaults and ranges, so that ComfyUI workflows
//! validate the same way here as there. Execution lives elsewhere (engine and
//! nodes); this module never does I/O.

use std::collections::BTreeMap;
use std::fmt;

/// The type carried by a link between two nodes.
///
/// Links are legal only between equal socket types. The named variants are
/// the ones the engine knows; `Custom` keeps ComfyUI's open-ended type names
/// (e.g. `SIGMAS`, `SAMPLER`) representable without a code change here.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SocketType {
    Model,
    Clip,
    Vae,
    Conditioning,
    Latent,
    Image,
    Mask,
    ControlNet,
    ClipVision,
    ClipVisionOutput,
    StyleModel,
    UpscaleModel,
    Gligen,
    Sampler,
    Sigmas,
    Noise,
    Guider,
    /// A widget type used as a socket (ComfyUI's `forceInput`, or an output
    /// such as `INT` from a primitive node).
    Int,
    Float,
    String,
    Boolean,
    Custom(std::string::String),
}

impl SocketType {
    /// ComfyUI's spelling of the type.
    pub fn name(&self) -> &str {
        match self {
            SocketType::Model => "MODEL",
            SocketType::Clip => "CLIP",
            SocketType::Vae => "VAE",
            SocketType::Conditioning => "CONDITIONING",
            SocketType::Latent => "LATENT",
            SocketType::Image => "IMAGE",
            SocketType::Mask => "MASK",
            SocketType::ControlNet => "CONTROL_NET",
            SocketType::ClipVision => "CLIP_VISION",
            SocketType::ClipVisionOutput => "CLIP_VISION_OUTPUT",
            SocketType::StyleModel => "STYLE_MODEL",
            SocketType::UpscaleModel => "UPSCALE_MODEL",
            SocketType::Gligen => "GLIGEN",
            SocketType::Sampler => "SAMPLER",
            SocketType::Sigmas => "SIGMAS",
            SocketType::Noise => "NOISE",
            SocketType::Guider => "GUIDER",
            SocketType::Int => "INT",
            SocketType::Float => "FLOAT",
            SocketType::String => "STRING",
            SocketType::Boolean => "BOOLEAN",
            SocketType::Custom(s) => s,
        }
    }

    /// Parses ComfyUI's spelling; unknown names become `Custom`.
    pub fn from_name(name: &str) -> SocketType {
        match name {
            "MODEL" => SocketType::Model,
            "CLIP" => SocketType::Clip,
            "VAE" => SocketType::Vae,
            "CONDITIONING" => SocketType::Conditioning,
            "LATENT" => SocketType::Latent,
            "IMAGE" => SocketType::Image,
            "MASK" => SocketType::Mask,
            "CONTROL_NET" => SocketType::ControlNet,
            "CLIP_VISION" => SocketType::ClipVision,
            "CLIP_VISION_OUTPUT" => SocketType::ClipVisionOutput,
            "STYLE_MODEL" => SocketType::StyleModel,
            "UPSCALE_MODEL" => SocketType::UpscaleModel,
            "GLIGEN" => SocketType::Gligen,
            "SAMPLER" => SocketType::Sampler,
            "SIGMAS" => SocketType::Sigmas,
            "NOISE" => SocketType::Noise,
            "GUIDER" => SocketType::Guider,
            "INT" => SocketType::Int,
            "FLOAT" => SocketType::Float,
            "STRING" => SocketType::String,
            "BOOLEAN" => SocketType::Boolean,
            other => SocketType::Custom(other.to_string()),
        }
    }

    /// ComfyUI's link rule: equal names, with `*` accepting anything.
    pub fn accepts(&self, received: &SocketType) -> bool {
        self == received || self.name() == "*" || received.name() == "*"
    }
}

impl fmt::Display for SocketType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a combo widget's options come from.
#[derive(Clone, Debug, PartialEq)]
pub enum ComboOptions {
    /// A fixed list, e.g. sampler names.
    Static(Vec<String>),
    /// Image files in the input directory (LoadImage).
    InputImages,
    /// Files in a model folder such as `checkpoints` or `vae`.
    Models(&'static str),
    /// VAELoader's list: the `vae` files, then `taesd`, `taesdxl`,
    /// `taesd3`, `taef1` where both halves are in `vae_approx`, then
    /// `pixel_space` (ComfyUI's `vae_list`).
    Vaes,
}

/// The value kind an input accepts.
#[derive(Clone, Debug, PartialEq)]
pub enum InputKind {
    /// A link from another node's output of this type.
    Socket(SocketType),
    Int {
        default: i128,
        min: i128,
        max: i128,
        step: i128,
        /// ComfyUI's front end adds a "control after generate" widget to
        /// seeds; it is UI-only, but the UI format stores its value.
        control_after_generate: bool,
    },
    Float {
        default: f64,
        min: f64,
        max: f64,
        step: f64,
        round: Option<f64>,
    },
    String {
        default: String,
        multiline: bool,
        dynamic_prompts: bool,
    },
    Boolean {
        default: bool,
    },
    Combo {
        options: ComboOptions,
        default: Option<String>,
        image_upload: bool,
    },
}

impl InputKind {
    /// The socket type a link into this input must carry. Widgets accept
    /// links of their own primitive type (ComfyUI's converted widgets).
    pub fn socket_type(&self) -> SocketType {
        match self {
            InputKind::Socket(t) => t.clone(),
            InputKind::Int { .. } => SocketType::Int,
            InputKind::Float { .. } => SocketType::Float,
            InputKind::String { .. } => SocketType::String,
            InputKind::Boolean { .. } => SocketType::Boolean,
            InputKind::Combo { .. } => SocketType::Custom("COMBO".into()),
        }
    }

    pub fn is_widget(&self) -> bool {
        !matches!(self, InputKind::Socket(_))
    }
}

/// One declared input of a node type.
#[derive(Clone, Debug, PartialEq)]
pub struct InputSpec {
    pub name: String,
    pub kind: InputKind,
    pub required: bool,
    pub tooltip: Option<String>,
}

/// One declared output of a node type.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputSpec {
    pub name: String,
    pub ty: SocketType,
    pub is_list: bool,
    pub tooltip: Option<String>,
}

/// Hidden inputs ComfyUI fills in from the request, not from the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hidden {
    Prompt,
    ExtraPngInfo,
    UniqueId,
}

/// Everything the engine and front ends need to know about a node type.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSpec {
    pub name: String,
    pub display_name: String,
    pub category: String,
    pub description: String,
    pub inputs: Vec<InputSpec>,
    pub outputs: Vec<OutputSpec>,
    pub output_node: bool,
    pub hidden: Vec<Hidden>,
    pub deprecated: bool,
    pub experimental: bool,
}

impl NodeSpec {
    pub fn input(&self, name: &str) -> Option<&InputSpec> {
        self.inputs.iter().find(|i| i.name == name)
    }

    /// Resolves an output reference (by name, then by ComfyUI type name) to
    /// its index.
    pub fn output_index(&self, name: &str) -> Option<usize> {
        self.outputs
            .iter()
            .position(|o| o.name == name)
            .or_else(|| self.outputs.iter().position(|o| o.ty.name() == name))
    }

    /// The widget inputs in the order ComfyUI's UI format stores their
    /// values, including the hidden "control after generate" slots.
    pub fn widget_slots(&self) -> Vec<WidgetSlot<'_>> {
        let mut slots = Vec::new();
        for input in &self.inputs {
            match &input.kind {
                InputKind::Socket(_) => {}
                InputKind::Int {
                    control_after_generate: true,
                    ..
                } => {
                    slots.push(WidgetSlot::Input(input));
                    slots.push(WidgetSlot::ControlAfterGenerate);
                }
                InputKind::Combo {
                    image_upload: true, ..
                } => {
                    slots.push(WidgetSlot::Input(input));
                    slots.push(WidgetSlot::Upload);
                }
                _ => slots.push(WidgetSlot::Input(input)),
            }
        }
        slots
    }
}

/// A slot in a UI-format node's `widgets_values` array.
#[derive(Clone, Copy, Debug)]
pub enum WidgetSlot<'a> {
    Input(&'a InputSpec),
    /// The seed widget's "fixed/increment/randomize" companion.
    ControlAfterGenerate,
    /// The image upload button; some front-end versions store a value for
    /// it, most do not.
    Upload,
}

/// All node types known to an engine, by name.
#[derive(Clone, Debug, Default)]
pub struct Registry {
    specs: BTreeMap<String, NodeSpec>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node type; a later spec with the same name replaces the earlier.
    pub fn insert(&mut self, spec: NodeSpec) {
        self.specs.insert(spec.name.clone(), spec);
    }

    pub fn get(&self, name: &str) -> Option<&NodeSpec> {
        self.specs.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &NodeSpec> {
        self.specs.values()
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

/// A fluent builder, so node definitions read like ComfyUI's INPUT_TYPES.
pub struct SpecBuilder {
    spec: NodeSpec,
}

/// Starts a node spec with the given type name and category.
pub fn node(name: &str, category: &str) -> SpecBuilder {
    SpecBuilder {
        spec: NodeSpec {
            name: name.to_string(),
            display_name: name.to_string(),
            category: category.to_string(),
            description: String::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            output_node: false,
            hidden: Vec::new(),
            deprecated: false,
            experimental: false,
        },
    }
}

impl SpecBuilder {
    pub fn display(mut self, name: &str) -> Self {
        self.spec.display_name = name.to_string();
        self
    }

    pub fn description(mut self, text: &str) -> Self {
        self.spec.description = text.to_string();
        self
    }

    pub fn output_node(mut self) -> Self {
        self.spec.output_node = true;
        self
    }

    pub fn deprecated(mut self) -> Self {
        self.spec.deprecated = true;
        self
    }

    pub fn experimental(mut self) -> Self {
        self.spec.experimental = true;
        self
    }

    pub fn hidden(mut self, h: Hidden) -> Self {
        self.spec.hidden.push(h);
        self
    }

    fn push(mut self, name: &str, kind: InputKind, required: bool) -> Self {
        self.spec.inputs.push(InputSpec {
            name: name.to_string(),
            kind,
            required,
            tooltip: None,
        });
        self
    }

    /// Sets the tooltip of the most recently added input.
    pub fn tip(mut self, text: &str) -> Self {
        if let Some(last) = self.spec.inputs.last_mut() {
            last.tooltip = Some(text.to_string());
        }
        self
    }

    pub fn socket(self, name: &str, ty: SocketType) -> Self {
        self.push(name, InputKind::Socket(ty), true)
    }

    pub fn optional_socket(self, name: &str, ty: SocketType) -> Self {
        self.push(name, InputKind::Socket(ty), false)
    }

    pub fn int(self, name: &str, default: i128, min: i128, max: i128, step: i128) -> Self {
        self.push(
            name,
            InputKind::Int {
                default,
                min,
                max,
                step,
                control_after_generate: false,
            },
            true,
        )
    }

    /// A seed: an INT whose UI carries a "control after generate" widget.
    pub fn seed(self, name: &str) -> Self {
        self.push(
            name,
            InputKind::Int {
                default: 0,
                min: 0,
                max: u64::MAX as i128,
                step: 1,
                control_after_generate: true,
            },
            true,
        )
    }

    pub fn float(self, name: &str, default: f64, min: f64, max: f64, step: f64) -> Self {
        self.push(
            name,
            InputKind::Float {
                default,
                min,
                max,
                step,
                round: None,
            },
            true,
        )
    }

    /// Sets ComfyUI's `round` option of the most recent FLOAT input.
    pub fn round(mut self, round: f64) -> Self {
        if let Some(InputSpec {
            kind: InputKind::Float { round: r, .. },
            ..
        }) = self.spec.inputs.last_mut()
        {
            *r = Some(round);
        }
        self
    }

    pub fn string(self, name: &str, default: &str) -> Self {
        self.push(
            name,
            InputKind::String {
                default: default.to_string(),
                multiline: false,
                dynamic_prompts: false,
            },
            true,
        )
    }

    pub fn text(self, name: &str) -> Self {
        self.push(
            name,
            InputKind::String {
                default: String::new(),
                multiline: true,
                dynamic_prompts: true,
            },
            true,
        )
    }

    pub fn boolean(self, name: &str, default: bool) -> Self {
        self.push(name, InputKind::Boolean { default }, true)
    }

    pub fn combo(self, name: &str, options: &[&str]) -> Self {
        self.push(
            name,
            InputKind::Combo {
                options: ComboOptions::Static(options.iter().map(|s| s.to_string()).collect()),
                default: None,
                image_upload: false,
            },
            true,
        )
    }

    /// Sets the default of the most recent COMBO input.
    pub fn combo_default(mut self, value: &str) -> Self {
        if let Some(InputSpec {
            kind: InputKind::Combo { default, .. },
            ..
        }) = self.spec.inputs.last_mut()
        {
            *default = Some(value.to_string());
        }
        self
    }

    /// A combo over the files of a model folder (`checkpoints`, `vae`, ...).
    pub fn models(self, name: &str, folder: &'static str) -> Self {
        self.push(
            name,
            InputKind::Combo {
                options: ComboOptions::Models(folder),
                default: None,
                image_upload: false,
            },
            true,
        )
    }

    /// VAELoader's combo ([`ComboOptions::Vaes`]).
    pub fn vaes(self, name: &str) -> Self {
        self.push(
            name,
            InputKind::Combo {
                options: ComboOptions::Vaes,
                default: None,
                image_upload: false,
            },
            true,
        )
    }

    /// A combo over the input directory's images, with an upload button.
    pub fn input_image(self, name: &str) -> Self {
        self.push(
            name,
            InputKind::Combo {
                options: ComboOptions::InputImages,
                default: None,
                image_upload: true,
            },
            true,
        )
    }

    /// Marks the most recently added input optional.
    pub fn optional(mut self) -> Self {
        if let Some(last) = self.spec.inputs.last_mut() {
            last.required = false;
        }
        self
    }

    pub fn output(mut self, name: &str, ty: SocketType) -> Self {
        self.spec.outputs.push(OutputSpec {
            name: name.to_string(),
            ty,
            is_list: false,
            tooltip: None,
        });
        self
    }

    /// An output named after its type, as ComfyUI names unnamed outputs.
    pub fn returns(self, ty: SocketType) -> Self {
        let name = ty.name().to_string();
        self.output(&name, ty)
    }

    pub fn build(self) -> NodeSpec {
        self.spec
    }
}
