//! A restricted pickle reader: the data half of Python's pickle machine,
//! with none of its code half.
//!
//! `torch.save` files are pickles, and a pickle is a program: its `GLOBAL`
//! opcode imports any callable and `REDUCE` calls it, which is how a
//! hostile file runs `os.system`. This reader interprets the opcodes that
//! build data (numbers, strings, tuples, lists, dicts, sets, the memo) and
//! resolves every global against a fixed table of what `torch.save` writes
//! for a state dict ([`Global`]): the tensor-rebuild functions, storage
//! types, `OrderedDict`, `torch.Size` and a few builtins, each of which is
//! *interpreted* here (a tensor rebuild becomes a [`TensorRef`], a storage
//! type becomes a [`DType`]). Nothing a file names is ever executed; a
//! global outside the table is an error naming it, as
//! `torch.load(weights_only=True)` refuses it.
//!
//! Training checkpoints (PyTorch Lightning) also pickle their callbacks and
//! loop state next to the weights. ComfyUI maps every `pytorch_lightning.*`
//! class to an empty object when it loads them; this reader does the same
//! with [`Value::Inert`], as it does for NumPy scalars in that metadata:
//! inert values carry nothing and run nothing.
//!
//! Every length is checked against the bytes left, values are shared
//! (`Rc`) rather than copied so a small file cannot expand into a large
//! memory image, and the stack and memo are bounded.

use super::DType;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Most values on the stack, and entries in the memo, a file may create.
/// Real state dicts stay far below (a few entries per tensor).
const MAX_OBJECTS: usize = 50_000_000;

/// A value built by the pickle program.
#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer beyond i64 (the legacy format's magic number).
    BigInt(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<[Value]>),
    List(Rc<RefCell<Vec<Value>>>),
    Dict(Rc<RefCell<Dict>>),
    /// A resolved global, before it is called.
    Global(Global),
    /// A storage named by a persistent id: where the bytes of tensors are.
    Storage(Rc<StorageRef>),
    /// A rebuilt tensor.
    Tensor(Rc<TensorRef>),
    /// An object of a class this reader does not model (Lightning callbacks,
    /// NumPy scalars): kept as a placeholder, never constructed.
    Inert(Rc<str>),
}

/// A dict in insertion order. Keys are compared by value for the types a
/// state dict uses (strings, integers); other keys are kept in order.
#[derive(Debug, Default)]
pub struct Dict {
    pub entries: Vec<(Value, Value)>,
    index: HashMap<Key, usize>,
}

#[derive(Debug, PartialEq, Eq, Hash)]
enum Key {
    Str(Rc<str>),
    Int(i64),
}

impl Dict {
    fn insert(&mut self, k: Value, v: Value) {
        let key = match &k {
            Value::Str(s) => Some(Key::Str(s.clone())),
            Value::Int(i) => Some(Key::Int(*i)),
            _ => None,
        };
        match key {
            Some(key) => match self.index.get(&key) {
                Some(&i) => self.entries[i].1 = v,
                None => {
                    self.index.insert(key, self.entries.len());
                    self.entries.push((k, v));
                }
            },
            None => self.entries.push((k, v)),
        }
    }

    /// The value under a string key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index
            .get(&Key::Str(Rc::from(key)))
            .map(|&i| &self.entries[i].1)
    }
}

/// A storage as its persistent id describes it.
#[derive(Debug)]
pub struct StorageRef {
    /// The storage's key: its file `data/<key>` in a zip checkpoint.
    pub key: String,
    pub dtype: DType,
    /// Element count, as the persistent id states it.
    pub numel: u64,
}

/// `_rebuild_tensor_v2(storage, offset, size, stride, ...)`.
#[derive(Debug)]
pub struct TensorRef {
    pub storage: Rc<StorageRef>,
    /// The element type (the storage's, unless the storage is untyped).
    pub dtype: DType,
    /// Offset into the storage, in elements.
    pub offset: u64,
    pub shape: Vec<u64>,
    pub stride: Vec<u64>,
}

/// The globals this reader understands. Everything else is refused.
#[derive(Clone, Debug)]
pub enum Global {
    RebuildTensor,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    OrderedDict,
    TorchSize,
    CodecsEncode,
    Set,
    FrozenSet,
    ByteArray,
    /// A typed storage class (`torch.HalfStorage`...): the element type.
    Storage(DType),
    /// A torch dtype (`torch.float8_e4m3fn`): `_rebuild_tensor_v3`'s
    /// element type over an untyped storage.
    DType(DType),
    /// A class that is never built ([`Value::Inert`]), or data describing
    /// types (`torch.float16`, `torch.device`) that a state dict does not need.
    Inert(Rc<str>),
}

impl Global {
    /// Resolves `module.name`, or refuses it.
    fn resolve(module: &str, name: &str) -> Result<Global, String> {
        // Python's unpickler maps Python 2 module names the same way.
        let module = match module {
            "__builtin__" => "builtins",
            "copy_reg" => "copyreg",
            m => m,
        };
        if matches!(module, "torch" | "torch.storage") {
            if let Some(dtype) = storage_dtype(name) {
                return Ok(Global::Storage(dtype));
            }
        }
        if module == "torch" {
            if let Some(dtype) = torch_dtype(name) {
                return Ok(Global::DType(dtype));
            }
        }
        let g = match (module, name) {
            ("torch._utils", "_rebuild_tensor") => Global::RebuildTensor,
            ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
            ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildTensorV3,
            ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
            ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
            ("torch._tensor", "_rebuild_from_type_v2") => Global::RebuildFromTypeV2,
            ("collections", "OrderedDict") => Global::OrderedDict,
            ("torch", "Size") => Global::TorchSize,
            ("_codecs", "encode") => Global::CodecsEncode,
            ("builtins", "set") => Global::Set,
            ("builtins", "frozenset") => Global::FrozenSet,
            ("builtins", "bytearray") => Global::ByteArray,
            ("torch", "Tensor")
            | ("torch.nn.parameter", "Parameter")
            | ("torch", "device")
            | ("torch", "strided")
            | ("numpy", "dtype")
            | ("numpy.core.multiarray" | "numpy._core.multiarray", "scalar") => {
                Global::Inert(format!("{module}.{name}").into())
            }
            (m, _) if m == "pytorch_lightning" || m.starts_with("pytorch_lightning.") => {
                Global::Inert(format!("{module}.{name}").into())
            }
            _ => return Err(format!("{module}.{name}")),
        };
        Ok(g)
    }
}

/// The element type of a typed storage class name.
fn storage_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "FloatStorage" => DType::F32,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "DoubleStorage" => DType::F64,
        "LongStorage" => DType::I64,
        "IntStorage" => DType::I32,
        "ShortStorage" => DType::I16,
        "CharStorage" => DType::I8,
        "ByteStorage" | "UntypedStorage" => DType::U8,
        "BoolStorage" => DType::Bool,
        "Float8_e4m3fnStorage" => DType::F8E4M3,
        "Float8_e5m2Storage" => DType::F8E5M2,
        _ => return None,
    })
}

/// The element type of a `torch.<dtype>` global.
fn torch_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "float16" | "half" => DType::F16,
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "bfloat16" => DType::BF16,
        "int64" | "long" => DType::I64,
        "int32" | "int" => DType::I32,
        "int16" | "short" => DType::I16,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "bool" => DType::Bool,
        "float8_e4m3fn" => DType::F8E4M3,
        "float8_e5m2" => DType::F8E5M2,
        _ => return None,
    })
}

/// Why a pickle could not be read. `offset` is the byte offset of the
/// opcode in the pickle stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickleError {
    pub offset: usize,
    pub kind: PickleErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickleErrorKind {
    /// A global outside the table: what a hostile file needs.
    Global(String),
    /// Anything else malformed or unsupported.
    Invalid(String),
}

impl std::fmt::Display for PickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            PickleErrorKind::Global(g) => write!(
                f,
                "refusing the pickle global `{g}` (at byte {}): sdkit rebuilds only tensors and \
                 plain containers from pickle files and never runs code a file names",
                self.offset
            ),
            PickleErrorKind::Invalid(why) => {
                write!(f, "invalid pickle at byte {}: {why}", self.offset)
            }
        }
    }
}

/// Reads one pickle from `data`; returns the value and the number of
/// bytes consumed (up to and including STOP). `persistent` turns a
/// persistent id into a value (the storages of a torch file).
pub fn load(
    data: &[u8],
    persistent: &mut dyn FnMut(&Value) -> Result<Value, String>,
) -> Result<(Value, usize), PickleError> {
    let mut m = Machine {
        data,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    let v = m.run(persistent)?;
    Ok((v, m.pos))
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    op_at: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

type R<T> = Result<T, PickleError>;

impl Machine<'_> {
    fn err<T>(&self, why: impl Into<String>) -> R<T> {
        Err(PickleError {
            offset: self.op_at,
            kind: PickleErrorKind::Invalid(why.into()),
        })
    }

    fn take(&mut self, n: usize) -> R<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => self.err(format!(
                "needs {n} bytes, {} left (truncated file)",
                self.data.len() - self.pos
            )),
        }
    }

    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> R<[u8; N]> {
        let b = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn len_u32(&mut self) -> R<usize> {
        Ok(u32::from_le_bytes(self.le()?) as usize)
    }

    fn len_u64(&mut self) -> R<usize> {
        let n = u64::from_le_bytes(self.le()?);
        match usize::try_from(n) {
            Ok(n) => Ok(n),
            Err(_) => self.err(format!("length {n} does not fit in memory")),
        }
    }

    /// A newline-terminated text argument (protocol 0 opcodes).
    fn line(&mut self) -> R<&str> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return self.err("unterminated text argument");
        };
        let start = self.pos;
        self.pos += n + 1;
        match std::str::from_utf8(&self.data[start..start + n]) {
            Ok(s) => Ok(s),
            Err(_) => self.err("text argument is not UTF-8"),
        }
    }

    fn push(&mut self, v: Value) -> R<()> {
        if self.stack.len() >= MAX_OBJECTS {
            return self.err("too many objects on the stack");
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self) -> R<Value> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return self.err("pop across a mark");
        }
        match self.stack.pop() {
            Some(v) => Ok(v),
            None => self.err("stack underflow"),
        }
    }

    fn top(&mut self) -> R<&mut Value> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return self.err("no value above the mark");
        }
        if self.stack.is_empty() {
            return self.err("stack underflow");
        }
        let last = self.stack.len() - 1;
        Ok(&mut self.stack[last])
    }

    /// The values since the last MARK, removing the mark.
    fn pop_mark(&mut self) -> R<Vec<Value>> {
        let Some(m) = self.marks.pop() else {
            return self.err("no MARK on the stack");
        };
        if m > self.stack.len() {
            return self.err("mark past the stack");
        }
        Ok(self.stack.split_off(m))
    }

    fn memo_put(&mut self, idx: u32) -> R<()> {
        if self.memo.len() >= MAX_OBJECTS {
            return self.err("memo too large");
        }
        let v = self.top()?.clone();
        self.memo.insert(idx, v);
        Ok(())
    }

    fn memo_get(&mut self, idx: u32) -> R<()> {
        match self.memo.get(&idx) {
            Some(v) => {
                let v = v.clone();
                self.push(v)
            }
            None => self.err(format!("memo entry {idx} was never stored")),
        }
    }

    fn global(&self, module: &str, name: &str) -> R<Value> {
        match Global::resolve(module, name) {
            Ok(g) => Ok(Value::Global(g)),
            Err(full) => Err(PickleError {
                offset: self.op_at,
                kind: PickleErrorKind::Global(full),
            }),
        }
    }

    fn run(&mut self, persistent: &mut dyn FnMut(&Value) -> Result<Value, String>) -> R<Value> {
        loop {
            self.op_at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return self.err(format!("pickle protocol {proto} is unknown"));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint only.
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?);
                    self.push(Value::Int(v.into()))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v.into()))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?);
                    self.push(Value::Int(v.into()))?
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        self.u8()? as usize
                    } else {
                        self.len_u32()?
                    };
                    let bytes = self.take(n)?.to_vec();
                    self.push(long_value(&bytes))?
                }
                b'I' | b'L' => {
                    let text = self.line()?.trim_end_matches('L').to_string();
                    let v = match text.as_str() {
                        "00" if op == b'I' => Value::Bool(false),
                        "01" if op == b'I' => Value::Bool(true),
                        t => match t.parse::<i64>() {
                            Ok(i) => Value::Int(i),
                            Err(_) => Value::BigInt(Rc::from(t.as_bytes())),
                        },
                    };
                    self.push(v)?
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le()?);
                    self.push(Value::Float(v))?
                }
                b'F' => {
                    let text = self.line()?.to_string();
                    match text.parse::<f64>() {
                        Ok(v) => self.push(Value::Float(v))?,
                        Err(_) => return self.err(format!("bad float {text:?}")),
                    }
                }
                0x8c | b'X' | 0x8d => {
                    let n = match op {
                        0x8c => self.u8()? as usize,
                        b'X' => self.len_u32()?,
                        _ => self.len_u64()?,
                    };
                    let bytes = self.take(n)?;
                    let s = match std::str::from_utf8(bytes) {
                        Ok(s) => Rc::from(s),
                        Err(_) => return self.err("string is not UTF-8"),
                    };
                    self.push(Value::Str(s))?
                }
                b'V' => {
                    // raw-unicode-escape; state dict names are ASCII.
                    let s: Rc<str> = Rc::from(self.line()?);
                    self.push(Value::Str(s))?
                }
                b'U' | b'T' => {
                    // Python 2 byte strings: names in old files, read as Latin-1.
                    let n = if op == b'U' {
                        self.u8()? as usize
                    } else {
                        self.len_u32()?
                    };
                    let s: String = self.take(n)?.iter().map(|&b| b as char).collect();
                    self.push(Value::Str(s.into()))?
                }
                b'S' => {
                    let text = self.line()?;
                    let inner = text
                        .strip_prefix('\'')
                        .and_then(|t| t.strip_suffix('\''))
                        .or_else(|| text.strip_prefix('"').and_then(|t| t.strip_suffix('"')));
                    match inner {
                        Some(s) if !s.contains('\\') => {
                            let s: Rc<str> = Rc::from(s);
                            self.push(Value::Str(s))?
                        }
                        _ => return self.err("escaped STRING arguments are not supported"),
                    }
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'C' => self.u8()? as usize,
                        b'B' => self.len_u32()?,
                        _ => self.len_u64()?,
                    };
                    let b: Rc<[u8]> = Rc::from(self.take(n)?);
                    self.push(Value::Bytes(b))?
                }
                b')' => self.push(Value::Tuple(Rc::from(Vec::new())))?,
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(Rc::from(items)))?
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(Rc::from(items)))?
                }
                b']' => self.push(Value::List(Rc::default()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(Rc::new(RefCell::new(items))))?
                }
                b'}' => self.push(Value::Dict(Rc::default()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    let dict = self.dict_from(items)?;
                    self.push(dict)?
                }
                0x8f => self.push(Value::List(Rc::default()))?,
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(Rc::new(RefCell::new(items))))?
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.append(items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?
                }
                b'p' => {
                    let text = self.line()?;
                    let idx = text.parse::<u32>();
                    match idx {
                        Ok(i) => self.memo_put(i)?,
                        Err(_) => return self.err("bad PUT index"),
                    }
                }
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(i.into())?
                }
                b'r' => {
                    let i = u32::from_le_bytes(self.le()?);
                    self.memo_put(i)?
                }
                0x94 => {
                    let i = u32::try_from(self.memo.len()).unwrap_or(u32::MAX);
                    self.memo_put(i)?
                }
                b'g' => {
                    let text = self.line()?;
                    match text.parse::<u32>() {
                        Ok(i) => self.memo_get(i)?,
                        Err(_) => return self.err("bad GET index"),
                    }
                }
                b'h' => {
                    let i = self.u8()?;
                    self.memo_get(i.into())?
                }
                b'j' => {
                    let i = u32::from_le_bytes(self.le()?);
                    self.memo_get(i)?
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    let g = self.global(&module, &name)?;
                    self.push(g)?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => {
                            let g = self.global(&m, &n)?;
                            self.push(g)?
                        }
                        _ => return self.err("STACK_GLOBAL needs two strings"),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let v = self.call(f, args)?;
                    self.push(v)?
                }
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.new_object(cls, args)?;
                    self.push(v)?
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.new_object(cls, args)?;
                    self.push(v)?
                }
                b'b' => {
                    // BUILD sets an object's state: a parameter's hooks, an
                    // inert object's fields. Nothing a state dict needs.
                    let _state = self.pop()?;
                    self.top()?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    match persistent(&pid) {
                        Ok(v) => self.push(v)?,
                        Err(why) => return self.err(why),
                    }
                }
                b'P' => {
                    let pid: Rc<str> = Rc::from(self.line()?);
                    match persistent(&Value::Str(pid)) {
                        Ok(v) => self.push(v)?,
                        Err(why) => return self.err(why),
                    }
                }
                b'i' | b'o' => {
                    return self.err("the INST/OBJ opcodes (class instantiation) are not supported")
                }
                0x82..=0x84 => return self.err("extension-registry opcodes are not supported"),
                0x97 | 0x98 => return self.err("out-of-band buffers are not supported"),
                other => return self.err(format!("unknown opcode 0x{other:02x}")),
            }
        }
    }

    fn dict_from(&self, items: Vec<Value>) -> R<Value> {
        if !items.len().is_multiple_of(2) {
            return self.err("dict items come in key/value pairs");
        }
        let mut d = Dict::default();
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.insert(k, v);
        }
        Ok(Value::Dict(Rc::new(RefCell::new(d))))
    }

    fn append(&mut self, items: Vec<Value>) -> R<()> {
        match self.top()? {
            Value::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            Value::Inert(_) => Ok(()),
            _ => self.err("APPEND to a value that is not a list"),
        }
    }

    fn set_items(&mut self, items: Vec<Value>) -> R<()> {
        if !items.len().is_multiple_of(2) {
            return self.err("SETITEMS needs key/value pairs");
        }
        match self.top()? {
            Value::Dict(d) => {
                let mut d = d.borrow_mut();
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.insert(k, v);
                }
                Ok(())
            }
            Value::Inert(_) => Ok(()),
            _ => self.err("SETITEM on a value that is not a dict"),
        }
    }

    fn new_object(&self, cls: Value, args: Value) -> R<Value> {
        match cls {
            Value::Global(Global::OrderedDict) => Ok(Value::Dict(Rc::default())),
            Value::Global(Global::Set | Global::FrozenSet) => {
                let items = match args {
                    Value::Tuple(t) => match t.first() {
                        Some(Value::List(l)) => l.borrow().clone(),
                        _ => Vec::new(),
                    },
                    _ => Vec::new(),
                };
                Ok(Value::List(Rc::new(RefCell::new(items))))
            }
            Value::Global(Global::Inert(name)) => Ok(Value::Inert(name)),
            other => self.err(format!("cannot instantiate {}", describe(&other))),
        }
    }

    /// REDUCE: the calls `torch.save` writes, interpreted.
    fn call(&self, f: Value, args: Value) -> R<Value> {
        let Value::Global(g) = f else {
            return self.err(format!("REDUCE on {}, not a callable", describe(&f)));
        };
        let args: Vec<Value> = match args {
            Value::Tuple(t) => t.to_vec(),
            other => return self.err(format!("REDUCE arguments are {}", describe(&other))),
        };
        match g {
            Global::RebuildTensor | Global::RebuildTensorV2 => self.rebuild_tensor(&args, None),
            Global::RebuildTensorV3 => match args.get(6) {
                // (storage, offset, size, stride, requires_grad, hooks, dtype, ...)
                Some(Value::Global(Global::DType(d))) => self.rebuild_tensor(&args, Some(*d)),
                _ => self.err("_rebuild_tensor_v3 needs a torch dtype as its 7th argument"),
            },
            Global::RebuildParameter | Global::RebuildParameterWithState => match args.first() {
                Some(t @ Value::Tensor(_)) => Ok(t.clone()),
                _ => self.err("_rebuild_parameter without a tensor"),
            },
            Global::RebuildFromTypeV2 => {
                // (func, new_type, args, state): the tensor is func(*args).
                match (args.first(), args.get(2)) {
                    (Some(func), Some(inner)) => self.call(func.clone(), inner.clone()),
                    _ => self.err("_rebuild_from_type_v2 needs (func, type, args, state)"),
                }
            }
            Global::OrderedDict => {
                let d = Value::Dict(Rc::default());
                if let Some(Value::List(pairs)) = args.first() {
                    let Value::Dict(dict) = &d else {
                        return self.err("unreachable");
                    };
                    for p in pairs.borrow().iter() {
                        match p {
                            Value::Tuple(kv) if kv.len() == 2 => {
                                dict.borrow_mut().insert(kv[0].clone(), kv[1].clone())
                            }
                            _ => return self.err("OrderedDict items must be pairs"),
                        }
                    }
                }
                Ok(d)
            }
            Global::TorchSize => match args.first() {
                Some(t @ Value::Tuple(_)) => Ok(t.clone()),
                _ => self.err("torch.Size needs a tuple"),
            },
            Global::CodecsEncode => match args.first() {
                // Protocol 2 writes bytes as _codecs.encode(str, 'latin1').
                Some(Value::Str(s)) => {
                    let mut out = Vec::with_capacity(s.len());
                    for c in s.chars() {
                        match u8::try_from(u32::from(c)) {
                            Ok(b) => out.push(b),
                            Err(_) => return self.err("_codecs.encode of a non-Latin-1 string"),
                        }
                    }
                    Ok(Value::Bytes(Rc::from(out)))
                }
                _ => self.err("_codecs.encode needs a string"),
            },
            Global::ByteArray => match args.first() {
                Some(b @ Value::Bytes(_)) => Ok(b.clone()),
                None => Ok(Value::Bytes(Rc::from(Vec::new()))),
                _ => self.err("bytearray of a non-bytes value"),
            },
            Global::Set | Global::FrozenSet => {
                self.new_object(Value::Global(Global::Set), Value::Tuple(Rc::from(args)))
            }
            Global::Inert(name) => Ok(Value::Inert(name)),
            Global::Storage(_) | Global::DType(_) => {
                self.err("storage classes and dtypes are not callable here")
            }
        }
    }

    /// `dtype` is the element type when it is not the storage's (v3 over
    /// an untyped storage).
    fn rebuild_tensor(&self, args: &[Value], dtype: Option<DType>) -> R<Value> {
        let (Some(Value::Storage(storage)), Some(offset), Some(shape), Some(stride)) =
            (args.first(), args.get(1), args.get(2), args.get(3))
        else {
            return self.err("_rebuild_tensor_v2 needs (storage, offset, size, stride, ...)");
        };
        let int = |v: &Value| match v {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        };
        let ints = |v: &Value| match v {
            Value::Tuple(t) => t.iter().map(int).collect::<Option<Vec<u64>>>(),
            _ => None,
        };
        let (Some(offset), Some(shape), Some(stride)) = (int(offset), ints(shape), ints(stride))
        else {
            return self.err("tensor offset, size and stride must be non-negative integers");
        };
        if shape.len() != stride.len() {
            return self.err(format!(
                "tensor size {shape:?} and stride {stride:?} differ in rank"
            ));
        }
        Ok(Value::Tensor(Rc::new(TensorRef {
            dtype: dtype.unwrap_or(storage.dtype),
            storage: storage.clone(),
            offset,
            shape,
            stride,
        })))
    }
}

/// LONG1/LONG4: little-endian two's complement.
fn long_value(bytes: &[u8]) -> Value {
    if bytes.len() <= 8 {
        let neg = bytes.last().is_some_and(|&b| b & 0x80 != 0);
        let mut buf = [if neg { 0xff } else { 0 }; 8];
        buf[..bytes.len()].copy_from_slice(bytes);
        Value::Int(i64::from_le_bytes(buf))
    } else {
        Value::BigInt(Rc::from(bytes))
    }
}

/// A short description of a value for error messages.
pub fn describe(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(_) => "a bool".into(),
        Value::Int(i) => format!("the integer {i}"),
        Value::BigInt(_) => "a big integer".into(),
        Value::Float(f) => format!("the float {f}"),
        Value::Str(s) => format!("the string {:?}", s.chars().take(40).collect::<String>()),
        Value::Bytes(b) => format!("{} bytes", b.len()),
        Value::Tuple(_) => "a tuple".into(),
        Value::List(_) => "a list".into(),
        Value::Dict(_) => "a dict".into(),
        Value::Global(g) => format!("the global {g:?}"),
        Value::Storage(_) => "a storage".into(),
        Value::Tensor(_) => "a tensor".into(),
        Value::Inert(name) => format!("an object of {name}"),
    }
}
