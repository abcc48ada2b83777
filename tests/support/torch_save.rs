//! Writes `torch.save`-format files (zip, pickle protocol 2) for tests
//! that need a `.ckpt`/`.pt` copy of a generated fixture: the tiny
//! checkpoints are megabytes, too large to commit twice. The byte layout
//! follows what PyTorch writes (`<archive>/data.pkl` naming each storage by
//! persistent id `('storage', torch.HalfStorage, key, 'cpu', numel)`,
//! `_rebuild_tensor_v2` per tensor, stored entries, CRC-32), and
//! `torch.load(weights_only=True)` reads these files; the reader itself is
//! proven on files PyTorch wrote (compute/tests/pickle.rs).

use sdkit_compute::weights::DType;
use std::path::Path;

/// A value to pickle: the containers a checkpoint uses.
pub enum Obj<'a> {
    Int(i64),
    Str(&'a str),
    /// (dtype, shape, little-endian bytes): one storage per tensor.
    Tensor(DType, &'a [usize], &'a [u8]),
    Dict(Vec<(&'a str, Obj<'a>)>),
}

struct Pickler {
    out: Vec<u8>,
    storages: Vec<Vec<u8>>,
}

impl Pickler {
    fn unicode(&mut self, s: &str) {
        self.out.push(b'X');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn int(&mut self, v: i64) {
        if (0..256).contains(&v) {
            self.out.extend_from_slice(&[b'K', v as u8]);
        } else {
            self.out.push(b'J');
            self.out.extend_from_slice(&(v as i32).to_le_bytes());
        }
    }

    fn tuple_of_ints(&mut self, v: &[usize]) {
        self.out.push(b'(');
        for &d in v {
            self.int(d as i64);
        }
        self.out.push(b't');
    }

    fn obj(&mut self, o: &Obj<'_>) {
        match o {
            Obj::Int(i) => self.int(*i),
            Obj::Str(s) => self.unicode(s),
            Obj::Dict(entries) => {
                self.out.extend_from_slice(b"ccollections\nOrderedDict\n)R");
                if !entries.is_empty() {
                    self.out.push(b'(');
                    for (k, v) in entries {
                        self.unicode(k);
                        self.obj(v);
                    }
                    self.out.push(b'u');
                }
            }
            Obj::Tensor(dtype, shape, bytes) => {
                let class = match dtype {
                    DType::F16 => "HalfStorage",
                    DType::F32 => "FloatStorage",
                    DType::BF16 => "BFloat16Storage",
                    other => panic!("no storage class for {other}"),
                };
                let key = self.storages.len().to_string();
                self.storages.push(bytes.to_vec());
                self.out
                    .extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
                // The persistent id tuple, then BINPERSID.
                self.out.push(b'(');
                self.unicode("storage");
                self.out
                    .extend_from_slice(format!("ctorch\n{class}\n").as_bytes());
                self.unicode(&key);
                self.unicode("cpu");
                self.int((bytes.len() / dtype.size_bytes()) as i64);
                self.out.extend_from_slice(b"tQ");
                self.int(0);
                self.tuple_of_ints(shape);
                let mut stride = vec![1usize; shape.len()];
                for i in (0..shape.len().saturating_sub(1)).rev() {
                    stride[i] = stride[i + 1] * shape[i + 1];
                }
                self.tuple_of_ints(&stride);
                self.out.push(0x89); // requires_grad False
                self.out.extend_from_slice(b"ccollections\nOrderedDict\n)R");
                self.out.extend_from_slice(b"tR");
            }
        }
    }
}

fn crc32(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (i, t) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *t = c;
    }
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// Writes `root` as PyTorch's zip format (entries 64-byte aligned, as
/// PyTorch aligns them).
pub fn write(path: &Path, root: &Obj<'_>) {
    let mut p = Pickler {
        out: vec![0x80, 2],
        storages: Vec::new(),
    };
    p.obj(root);
    p.out.push(b'.');
    let mut entries: Vec<(String, Vec<u8>)> = vec![("archive/data.pkl".into(), p.out)];
    entries.push(("archive/byteorder".into(), b"little".to_vec()));
    for (i, s) in p.storages.into_iter().enumerate() {
        entries.push((format!("archive/data/{i}"), s));
    }
    entries.push(("archive/version".into(), b"3\n".to_vec()));
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in &entries {
        let offset = out.len() as u32;
        let crc = crc32(data);
        // Pad the local extra field so the data starts 64-byte aligned.
        let fixed = out.len() + 30 + name.len() + 4;
        let pad = (64 - fixed % 64) % 64;
        let extra_len = 4 + pad;
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&(extra_len as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&0x1234u16.to_le_bytes());
        out.extend_from_slice(&(pad as u16).to_le_bytes());
        out.extend(std::iter::repeat_n(0u8, pad));
        out.extend_from_slice(data);
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 12]);
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd_offset = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    std::fs::write(path, out).expect("write torch file");
}
