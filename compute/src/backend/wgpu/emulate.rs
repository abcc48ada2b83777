//! Cooperative-matrix kernels on adapters without cooperative matrices:
//! rewrites a generated shader's fragment types and operations into plain
//! WGSL with subgroup broadcasts, so the tensor-core kernels' indexing,
//! staging, barriers and softmax logic run on Mesa's lavapipe in CI, not
//! only on the GPUs that have tensor cores.
//!
//! The fragment is T×T with a subgroup of exactly T lanes: lane r holds
//! row r of every fragment (`array<s, T>`). A load or store moves the
//! lane's row; a multiply-add takes A's row from the lane itself and B's
//! row k from lane k by broadcast, accumulating the exact f16 products in
//! f32 as tensor cores do. The layout inside a real fragment is opaque to
//! the kernels, so any layout is a faithful stand-in.
//!
//! Semantics follow naga's: `coopLoad`/`coopStore` address element
//! (r, c) at `c·stride + r` (column-major), the `T` forms at
//! `r·stride + c` (row-major).

use super::codegen::is_ident;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write;

/// Rewrites `src` (a complete generated shader) for fragments of
/// `tile`×`tile` in subgroups of `lanes` lanes (which must equal `tile`).
/// Errors name the construct the emulation does not cover.
pub fn emulate(src: &str, tile: usize, lanes: usize) -> Result<String, String> {
    if tile != lanes {
        return Err(format!(
            "emulated {tile}x{tile} fragments need subgroups of {tile} lanes, not {lanes}"
        ));
    }
    let mut e = Emulator {
        tile,
        fragments: fragment_scalars(src),
        arrays: array_scalars(src),
        loads: BTreeSet::new(),
        stores: BTreeSet::new(),
        mma: false,
    };
    let body = src.replace("enable wgpu_cooperative_matrix;\n", "");
    let body = e.rewrite(&body)?;
    let body = replace_types(&body)?;
    let mut out = body;
    e.helpers(&mut out)?;
    Ok(out)
}

const CALLS: [&str; 5] = [
    "coopLoadT",
    "coopLoad",
    "coopStoreT",
    "coopStore",
    "coopMultiplyAdd",
];

struct Emulator {
    tile: usize,
    /// Fragment variable → its scalar type (`f16`/`f32`).
    fragments: HashMap<String, String>,
    /// Workgroup and storage array → its element type.
    arrays: HashMap<String, String>,
    /// (array, fragment scalar, row-major) of every load.
    loads: BTreeSet<(String, String, bool)>,
    /// (array, row-major) of every store.
    stores: BTreeSet<(String, bool)>,
    mma: bool,
}

/// The index one past the bracket closing the one at `open`, counting
/// only `open_c`/`close_c` (arguments here hold index arithmetic, calls
/// and subscripts, never comparisons inside template brackets).
pub(super) fn matching(s: &str, open: usize, open_c: u8, close_c: u8) -> Option<usize> {
    let mut depth = 0usize;
    for (i, &b) in s.as_bytes().iter().enumerate().skip(open) {
        if b == open_c {
            depth += 1;
        } else if b == close_c {
            depth -= 1;
            if depth == 0 {
                return Some(i + 1);
            }
        }
    }
    None
}

/// Splits a call's argument text at top-level commas.
fn split_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for ch in s.chars() {
        match ch {
            '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

/// The scalar type named in a `coop_matAxB<scalar, role>` type.
fn scalar_of(ty: &str) -> Result<String, String> {
    let lt = ty
        .find('<')
        .ok_or_else(|| format!("fragment type {ty} has no parameters"))?;
    let rest = &ty[lt + 1..];
    let comma = rest
        .find(',')
        .ok_or_else(|| format!("fragment type {ty} has no role"))?;
    Ok(rest[..comma].trim().to_string())
}

/// `&ARRAY[INDEX]` → (ARRAY, INDEX).
fn pointer(arg: &str) -> Result<(String, String), String> {
    let p = arg
        .strip_prefix('&')
        .ok_or_else(|| format!("fragment pointer {arg} is not &array[index]"))?;
    let open = p
        .find('[')
        .ok_or_else(|| format!("fragment pointer {arg} is not &array[index]"))?;
    let close = matching(p, open, b'[', b']')
        .filter(|&c| c == p.len())
        .ok_or_else(|| format!("fragment pointer {arg} is not &array[index]"))?;
    Ok((p[..open].to_string(), p[open + 1..close - 1].to_string()))
}

/// Fragment variables declared as `var x = coop_mat…<s, R>();` or bound
/// by `let x = coopLoad…<coop_mat…<s, R>>(…)`.
fn fragment_scalars(src: &str) -> HashMap<String, String> {
    let mut m = HashMap::new();
    for line in src.lines() {
        let l = line.trim_start();
        let Some(rest) = l.strip_prefix("var ").or_else(|| l.strip_prefix("let ")) else {
            continue;
        };
        let Some((name, value)) = rest.split_once('=') else {
            continue;
        };
        let value = value.trim_start();
        if !(value.starts_with("coop_mat") || value.starts_with("coopLoad")) {
            continue;
        }
        let Some(at) = value.find("coop_mat") else {
            continue;
        };
        if let Ok(s) = scalar_of(&value[at..]) {
            m.insert(name.trim().to_string(), s);
        }
    }
    m
}

/// Module-scope arrays: `var<…> NAME: array<TYPE…`.
pub(super) fn array_scalars(src: &str) -> HashMap<String, String> {
    let mut m = HashMap::new();
    for line in src.lines() {
        let Some(v) = line.find("var<") else {
            continue;
        };
        let Some(gt) = line[v..].find('>') else {
            continue;
        };
        let rest = &line[v + gt + 1..];
        let Some((name, ty)) = rest.split_once(':') else {
            continue;
        };
        let Some(inner) = ty.trim().strip_prefix("array<") else {
            continue;
        };
        let scalar: String = inner.chars().take_while(|c| c.is_alphanumeric()).collect();
        m.insert(name.trim().to_string(), scalar);
    }
    m
}

/// Replaces every `coop_matAxB<s, R>` with `array<s, B>` (a lane's row).
fn replace_types(src: &str) -> Result<String, String> {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find("coop_mat") {
        out.push_str(&rest[..at]);
        let tail = &rest[at + "coop_mat".len()..];
        let lt = tail
            .find('<')
            .ok_or("fragment type without parameters".to_string())?;
        let (_, b) = tail[..lt]
            .split_once('x')
            .ok_or("fragment type without AxB".to_string())?;
        let elems = b
            .parse::<usize>()
            .map_err(|e| format!("fragment size {b}: {e}"))?;
        let close = matching(tail, lt, b'<', b'>').ok_or("unclosed fragment type".to_string())?;
        let scalar = scalar_of(&tail[..close])?;
        let _ = write!(out, "array<{scalar}, {elems}>");
        rest = &tail[close..];
    }
    out.push_str(rest);
    Ok(out)
}

impl Emulator {
    /// Rewrites every cooperative call in `s` (arguments first, so nested
    /// calls work).
    fn rewrite(&mut self, s: &str) -> Result<String, String> {
        let bytes = s.as_bytes();
        let mut out = String::with_capacity(s.len());
        let mut i = 0;
        while i < s.len() {
            let call = (i == 0 || !is_ident(bytes[i - 1]))
                .then(|| {
                    CALLS.into_iter().find(|c| {
                        s[i..].starts_with(c)
                            && !bytes.get(i + c.len()).copied().is_some_and(is_ident)
                    })
                })
                .flatten();
            let Some(name) = call else {
                // Copy one whole character (the source is ASCII, but keep
                // any comment text intact).
                let ch = s[i..].chars().next().unwrap_or(' ');
                out.push(ch);
                i += ch.len_utf8();
                continue;
            };
            let mut j = i + name.len();
            let mut template = None;
            if bytes.get(j) == Some(&b'<') {
                let close = matching(s, j, b'<', b'>')
                    .ok_or_else(|| format!("unclosed template after {name}"))?;
                template = Some(s[j + 1..close - 1].to_string());
                j = close;
            }
            if bytes.get(j) != Some(&b'(') {
                return Err(format!("{name} without arguments"));
            }
            let close = matching(s, j, b'(', b')')
                .ok_or_else(|| format!("unclosed arguments of {name}"))?;
            let args = split_args(&s[j + 1..close - 1])
                .iter()
                .map(|a| self.rewrite(a))
                .collect::<Result<Vec<_>, _>>()?;
            out.push_str(&self.call(name, template.as_deref(), &args)?);
            i = close;
        }
        Ok(out)
    }

    fn call(
        &mut self,
        name: &str,
        template: Option<&str>,
        args: &[String],
    ) -> Result<String, String> {
        let row_major = name.ends_with('T');
        let layout = if row_major { "r" } else { "c" };
        match name {
            "coopLoad" | "coopLoadT" => {
                let ty = template.ok_or_else(|| format!("{name} without a fragment type"))?;
                let scalar = scalar_of(ty)?;
                let [ptr, stride] = args else {
                    return Err(format!("{name} takes a pointer and a stride"));
                };
                let (array, index) = pointer(ptr)?;
                self.loads
                    .insert((array.clone(), scalar.clone(), row_major));
                Ok(format!(
                    "cl_{array}_{scalar}_{layout}({index}, {stride}, lane)"
                ))
            }
            "coopStore" | "coopStoreT" => {
                let [value, ptr, stride] = args else {
                    return Err(format!("{name} takes a fragment, a pointer and a stride"));
                };
                match self.fragments.get(value).map(String::as_str) {
                    Some("f32") => {}
                    other => {
                        return Err(format!(
                            "{name} of {value}: only f32 fragment variables are emulated (found {other:?})"
                        ))
                    }
                }
                let (array, index) = pointer(ptr)?;
                self.stores.insert((array.clone(), row_major));
                Ok(format!(
                    "cs_{array}_{layout}({value}, {index}, {stride}, lane)"
                ))
            }
            "coopMultiplyAdd" => {
                let [a, b, c] = args else {
                    return Err("coopMultiplyAdd takes three fragments".into());
                };
                self.mma = true;
                Ok(format!("cmma({a}, {b}, {c})"))
            }
            _ => Err(format!("{name} is not emulated")),
        }
    }

    /// Appends the helper functions the rewritten calls use.
    fn helpers(&self, out: &mut String) -> Result<(), String> {
        let t = self.tile;
        // Element (lane, c) of the fragment.
        let addr = |row_major: bool| {
            if row_major {
                "base + lane * stride + c"
            } else {
                "base + c * stride + lane"
            }
        };
        for (array, scalar, row_major) in &self.loads {
            let layout = if *row_major { "r" } else { "c" };
            let _ = write!(
                out,
                "
fn cl_{array}_{scalar}_{layout}(base: u32, stride: u32, lane: u32) -> array<{scalar}, {t}> {{
    var f: array<{scalar}, {t}>;
    for (var c = 0u; c < {t}u; c++) {{ f[c] = {scalar}({array}[{addr}]); }}
    return f;
}}
",
                addr = addr(*row_major)
            );
        }
        for (array, row_major) in &self.stores {
            let layout = if *row_major { "r" } else { "c" };
            let elem = self
                .arrays
                .get(array)
                .ok_or_else(|| format!("store into {array}, which is not a module-scope array"))?;
            let _ = write!(
                out,
                "
fn cs_{array}_{layout}(x: array<f32, {t}>, base: u32, stride: u32, lane: u32) {{
    var f = x;
    for (var c = 0u; c < {t}u; c++) {{ {array}[{addr}] = {elem}(f[c]); }}
}}
",
                addr = addr(*row_major)
            );
        }
        if self.mma {
            // Row k of B is lane k's: broadcast from a constant lane, which
            // software adapters compile to a plain extract (a shuffle with a
            // lane index costs lavapipe ~6× the compile time).
            let mut body = String::new();
            for k in 0..t {
                let _ = writeln!(body, "    let a{k} = f32(a[{k}]);");
                for col in 0..t {
                    let _ = writeln!(
                        body,
                        "    fc[{col}] = fc[{col}] + a{k} * subgroupBroadcast(f32(b[{col}]), {k}u);"
                    );
                }
            }
            let _ = write!(
                out,
                "
fn cmma(a: array<f16, {t}>, b: array<f16, {t}>, c: array<f32, {t}>) -> array<f32, {t}> {{
    var fc = c;
{body}    return fc;
}}
"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_nested_calls_and_types() {
        let src = "enable f16;
enable wgpu_cooperative_matrix;
var<workgroup> Vs: array<f16, 256>;
var<workgroup> Ss: array<f32, 256>;
fn main(lane: u32) {
    var acc = coop_mat8x8<f32, C>();
    let pa = coopLoadT<coop_mat8x8<f16, A>>(&Vs[0u], 16u);
    acc = coopMultiplyAdd(pa, coopLoad<coop_mat8x8<f16, B>>(&Vs[min(1u, 2u) * 8u], 16u), acc);
    coopStoreT(acc, &Ss[lane * 0u], 8u);
}
";
        let out = emulate(src, 8, 8).expect("emulates");
        assert!(!out.contains("coop"), "{out}");
        assert!(out.contains("var acc = array<f32, 8>();"), "{out}");
        assert!(
            out.contains("let pa = cl_Vs_f16_r(0u, 16u, lane);"),
            "{out}"
        );
        assert!(
            out.contains("acc = cmma(pa, cl_Vs_f16_c(min(1u, 2u) * 8u, 16u, lane), acc);"),
            "{out}"
        );
        assert!(out.contains("cs_Ss_r(acc, lane * 0u, 8u, lane);"), "{out}");
        assert!(out.contains("Ss[base + lane * stride + c] = f32(f[c]);"));
        assert!(out.contains("f[c] = f16(Vs[base + c * stride + lane]);"));
    }

    #[test]
    fn unknown_fragments_are_refused_by_name() {
        let src = "var<workgroup> Ss: array<f32, 64>;\nfn f() { coopStore(x, &Ss[0u], 8u); }\n";
        let err = emulate(src, 8, 8).expect_err("x is not a known fragment");
        assert!(err.contains("coopStore of x"), "{err}");
        let err = emulate(src, 16, 32).expect_err("a lane per row");
        assert!(err.contains("subgroups of 16 lanes"), "{err}");
    }
}
