//! A test aid for trusted shaders: fills every workgroup variable with
//! garbage (NaN for floats) before the kernel's own code runs.
//!
//! Shaders are compiled without wgpu's zero-initialisation of workgroup
//! memory ([`super::Options::shader_checks`] off), so a kernel that reads
//! a workgroup element it never wrote would read whatever the previous
//! workgroup left there: usually zero on a fresh run, garbage later. With
//! the poison the conformance suite sees any such read as NaN in the
//! output, on every run.

use std::fmt::Write;

/// `src` with a prologue at the top of `fn main` that writes a poison
/// value to every element of every `var<workgroup>` and then waits at a
/// workgroup barrier. Errors name what the rewrite could not find.
pub fn poison_workgroup_memory(src: &str) -> Result<String, String> {
    let vars = workgroup_vars(src)?;
    if vars.is_empty() {
        return Ok(src.to_string());
    }
    let threads = workgroup_threads(src)?;
    let main = entry_point(src)
        .map_err(|e| format!("poison: {e}"))?
        .ok_or("poison: no `fn main(` in the shader")?;
    let (params_end, body) = (main.params.end, main.body.start);
    let params = &src[main.params];
    let (index, extra_param) = entry_builtin(params, "local_invocation_index", "u32", "poison_li");
    // The NaN pattern through a runtime value: naga folds a constant
    // bitcast and refuses a non-finite constant.
    let mut prologue = format!("    let poison_bits = 0x7fc00000u + min({index}, 0u);\n");
    for (name, ty) in &vars {
        match ty {
            VarType::Array(scalar, len) => {
                let _ = writeln!(
                    prologue,
                    "    for (var e = {index}; e < {len}u; e += {threads}u) {{ {name}[e] = {}; }}",
                    poison_value(scalar)?
                );
            }
            VarType::Atomic(scalar) => {
                let _ = writeln!(
                    prologue,
                    "    if ({index} == 0u) {{ atomicStore(&{name}, {}); }}",
                    poison_value(scalar)?
                );
            }
            VarType::Scalar(scalar) => {
                let _ = writeln!(
                    prologue,
                    "    if ({index} == 0u) {{ {name} = {}; }}",
                    poison_value(scalar)?
                );
            }
        }
    }
    prologue.push_str("    workgroupBarrier();\n");
    let mut out = String::with_capacity(src.len() + prologue.len() + 64);
    out.push_str(&src[..params_end]);
    out.push_str(&extra_param);
    out.push_str(&src[params_end..body]);
    out.push('\n');
    out.push_str(&prologue);
    out.push_str(&src[body..]);
    Ok(out)
}

enum VarType {
    Array(String, usize),
    Atomic(String),
    Scalar(String),
}

fn workgroup_vars(src: &str) -> Result<Vec<(String, VarType)>, String> {
    let mut vars = Vec::new();
    for line in src.lines() {
        let Some(decl) = line.trim().strip_prefix("var<workgroup>") else {
            continue;
        };
        let decl = decl.trim().trim_end_matches(';');
        let (name, ty) = decl
            .split_once(':')
            .ok_or_else(|| format!("poison: untyped workgroup variable `{decl}`"))?;
        let ty = ty.trim();
        let parsed = if let Some(inner) =
            ty.strip_prefix("array<").and_then(|t| t.strip_suffix('>'))
        {
            let (scalar, len) = inner
                .split_once(',')
                .ok_or_else(|| format!("poison: runtime-sized workgroup array `{decl}`"))?;
            let len = len
                .trim()
                .trim_end_matches('u')
                .parse()
                .map_err(|_| format!("poison: array length in `{decl}` is not a literal"))?;
            VarType::Array(scalar.trim().to_string(), len)
        } else if let Some(scalar) = ty.strip_prefix("atomic<").and_then(|t| t.strip_suffix('>')) {
            VarType::Atomic(scalar.trim().to_string())
        } else {
            VarType::Scalar(ty.to_string())
        };
        vars.push((name.trim().to_string(), parsed));
    }
    Ok(vars)
}

/// Threads per workgroup from `@workgroup_size(x[, y[, z]])`.
fn workgroup_threads(src: &str) -> Result<usize, String> {
    let at = src
        .find("@workgroup_size(")
        .ok_or("poison: no @workgroup_size")?;
    let open = at + "@workgroup_size".len();
    let close = matching_paren(src, open)?;
    src[open + 1..close]
        .split(',')
        .map(|d| d.trim().trim_end_matches('u').parse::<usize>())
        .try_fold(1usize, |acc, d| d.map(|d| acc * d))
        .map_err(|_| "poison: @workgroup_size is not literal".to_string())
}

/// The index of the `)` closing the `(` at `open`.
fn matching_paren(src: &str, open: usize) -> Result<usize, String> {
    super::emulate::matching(src, open, b'(', b')')
        .map(|past| past - 1)
        .ok_or_else(|| "poison: unbalanced parentheses".to_string())
}

/// Byte ranges of `fn main`'s parameter list and body, each without its
/// parentheses or braces.
pub(super) struct EntryPoint {
    pub params: std::ops::Range<usize>,
    pub body: std::ops::Range<usize>,
}

/// Where `src`'s entry point `fn main` has its parameters and body; None
/// where there is no `fn main(`. Errors name what is unbalanced.
pub(super) fn entry_point(src: &str) -> Result<Option<EntryPoint>, String> {
    let Some(main) = src.find("fn main(") else {
        return Ok(None);
    };
    let open = main + "fn main".len();
    let params_end = super::emulate::matching(src, open, b'(', b')')
        .ok_or("unbalanced parentheses in `fn main`")?
        - 1;
    let brace = params_end + src[params_end..].find('{').ok_or("`fn main` has no body")?;
    let body_end =
        super::emulate::matching(src, brace, b'{', b'}').ok_or("unbalanced braces in `fn main`")?;
    Ok(Some(EntryPoint {
        params: open + 1..params_end,
        body: brace + 1..body_end - 1,
    }))
}

/// The name under which an entry point with parameters `params` sees
/// `@builtin(builtin)`, and the parameter text to append for it: none
/// where the entry point binds it already (each built-in may be bound
/// once), else `fallback` of type `ty`.
pub(super) fn entry_builtin(
    params: &str,
    builtin: &str,
    ty: &str,
    fallback: &str,
) -> (String, String) {
    match builtin_name(params, builtin) {
        Some(name) => (name.to_string(), String::new()),
        None => (
            fallback.to_string(),
            format!(
                "{}@builtin({builtin}) {fallback}: {ty}",
                if params.trim().is_empty() { "" } else { ", " }
            ),
        ),
    }
}

/// The parameter name bound to `@builtin(builtin)` in an entry point's
/// parameter list.
fn builtin_name<'a>(params: &'a str, builtin: &str) -> Option<&'a str> {
    let tag = format!("@builtin({builtin})");
    let rest = params[params.find(&tag)? + tag.len()..].trim_start();
    Some(rest.split(':').next()?.trim())
}

fn poison_value(scalar: &str) -> Result<&'static str, String> {
    Ok(match scalar {
        "f32" => "bitcast<f32>(poison_bits)",
        "f16" => "f16(bitcast<f32>(poison_bits))",
        "u32" => "0xdeadbeefu",
        "i32" => "-559038737i",
        other => return Err(format!("poison: no poison value for `{other}`")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(src: &str) {
        let module = naga::front::wgsl::parse_str(&format!("enable f16;\n{src}"))
            .unwrap_or_else(|e| panic!("{src}\n{e}"));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{src}\n{e:?}"));
    }

    #[test]
    fn fills_every_kind_of_workgroup_variable_before_the_body() {
        let src = "var<workgroup> As: array<f16, 64>;\nvar<workgroup> red: array<f32, 256>;\nvar<workgroup> flag: atomic<u32>;\n@compute @workgroup_size(8, 4)\nfn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {\n    As[tid] = f16(1.0);\n}\n";
        let out = poison_workgroup_memory(src).expect("poisons");
        let body = &out[out.find("tid: u32) {").expect("found")..];
        assert!(body.contains(
            "for (var e = tid; e < 64u; e += 32u) { As[e] = f16(bitcast<f32>(poison_bits)); }"
        ));
        assert!(body.contains("{ red[e] = bitcast<f32>(poison_bits); }"));
        assert!(body.contains("if (tid == 0u) { atomicStore(&flag, 0xdeadbeefu); }"));
        // The fill comes first, behind a barrier.
        let barrier = body.find("workgroupBarrier();").expect("found");
        assert!(barrier < body.find("As[tid] = f16(1.0)").expect("found"));
        valid(&out);
    }

    #[test]
    fn adds_the_local_index_when_the_kernel_has_none() {
        let src = "var<workgroup> Ks: array<f32, 100>;\n@compute @workgroup_size(64)\nfn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {\n    Ks[lid.x] = 1.0;\n}\n";
        let out = poison_workgroup_memory(src).expect("poisons");
        assert!(out.contains("lid: vec3<u32>, @builtin(local_invocation_index) poison_li: u32) {"));
        assert!(out.contains("for (var e = poison_li; e < 100u; e += 64u)"));
        valid(&out);
    }

    #[test]
    fn leaves_shaders_without_workgroup_memory_alone() {
        let src = "@compute @workgroup_size(256)\nfn main() {}\n";
        assert_eq!(poison_workgroup_memory(src).expect("poisons"), src);
    }

    #[test]
    fn refuses_what_it_cannot_poison_by_name() {
        let src = "var<workgroup> m: mat2x2<f32>;\n@compute @workgroup_size(1)\nfn main() {}\n";
        let e = poison_workgroup_memory(src).expect_err("refused");
        assert!(e.contains("mat2x2<f32>"), "{e}");
    }
}
