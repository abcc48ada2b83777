//! Shaders for software adapters (Mesa's lavapipe, the CI's adapter):
//! counted loops kept as loops.
//!
//! The generator gives loops literal trip counts so GPU compilers unroll
//! them and issue a staging loop's loads together. Mesa unrolls them too,
//! and lavapipe then compiles every per-lane memory access of every copy
//! on its own: an emulated cooperative attention kernel took ~11 s to
//! compile, ~4 s with its loops kept, and a cold conformance suite spent
//! half its time there. On a CPU the unrolled copies buy nothing
//! measurable, so on software adapters each counted loop in the entry
//! point gets a bound the compiler cannot fold: `N + z`, where `z` is the
//! workgroup count along z (at most 65,535) shifted right by 16, zero at
//! run time. What the loop computes is unchanged; hardware adapters get
//! the shader as generated.

use super::emulate::{array_scalars, matching};
use super::poison::{entry_builtin, entry_point};
use std::fmt::Write;

/// `src` with the trip counts of `fn main`'s counted loops
/// (`for (var v = …; v < Nu; …)`) hidden from the compiler. A loop that
/// indexes a function-local array with an expression of its counter
/// keeps its literal bound: unrolling is what keeps such an array (a
/// fragment, an accumulator tile) in registers. Vectors indexed by a
/// counter do not count: a vector stays in registers either way. Errors
/// name what could not be parsed.
pub fn keep_loops(src: &str) -> Result<String, String> {
    let Some(main) = entry_point(src).map_err(|e| format!("keep_loops: {e}"))? else {
        return Ok(src.to_string());
    };
    let params = &src[main.params.clone()];
    let module_arrays = array_scalars(src);
    let local_arrays: std::collections::HashSet<&str> = src
        .match_indices(": array<")
        .chain(src.match_indices(" = array<"))
        .map(|(at, _)| {
            let name = src[..at].trim_end_matches(' ');
            let len = name
                .bytes()
                .rev()
                .take_while(|&b| super::codegen::is_ident(b))
                .count();
            &name[name.len() - len..]
        })
        .filter(|name| !name.is_empty() && !module_arrays.contains_key(*name))
        .collect();
    let mut body = String::with_capacity(main.body.len() + 256);
    let mut rest = &src[main.body.clone()];
    let mut kept = 0;
    while let Some(f) = rest.find("for (var ") {
        body.push_str(&rest[..f]);
        let from_for = &rest[f..];
        let paren = "for ".len();
        let close =
            matching(from_for, paren, b'(', b')').ok_or("keep_loops: unclosed loop header")?;
        let header = &from_for[..close];
        let counter = ident_at(header, "for (var ".len());
        let loop_body = from_for[close..]
            .find('{')
            .and_then(|b| {
                matching(from_for, close + b, b'{', b'}').map(|e| &from_for[close + b..e])
            })
            .ok_or("keep_loops: loop without a body")?;
        match literal_bound(header, counter) {
            Some(end) if !indexes_local(loop_body, counter, &local_arrays) => {
                let _ = write!(body, "{} + emu_zero{}", &header[..end], &header[end..]);
                kept += 1;
            }
            _ => body.push_str(header),
        }
        rest = &from_for[close..];
    }
    body.push_str(rest);
    if kept == 0 {
        return Ok(src.to_string());
    }
    let (nwg, extra_param) = entry_builtin(params, "num_workgroups", "vec3<u32>", "emu_nwg");
    Ok(format!(
        "{}{extra_param}{}\n    let emu_zero = {nwg}.z >> 16u;{body}{}",
        &src[..main.params.end],
        &src[main.params.end..main.body.start],
        &src[main.body.end..]
    ))
}

/// The identifier starting at byte `at` of `s`.
fn ident_at(s: &str, at: usize) -> &str {
    let len = s[at..]
        .bytes()
        .take_while(|&b| super::codegen::is_ident(b))
        .count();
    &s[at..at + len]
}

/// Where the literal bound of `header`'s `counter < Nu;` condition ends
/// (just past the digits, before the `u`), if it has one.
fn literal_bound(header: &str, counter: &str) -> Option<usize> {
    let cond = format!("; {counter} < ");
    let start = header.find(&cond)? + cond.len();
    let digits = header[start..]
        .bytes()
        .take_while(u8::is_ascii_digit)
        .count();
    (digits > 0 && header[start + digits..].starts_with("u;")).then_some(start + digits + 1)
}

/// Whether `body` indexes one of `local_arrays` with an expression
/// naming `counter`.
fn indexes_local(
    body: &str,
    counter: &str,
    local_arrays: &std::collections::HashSet<&str>,
) -> bool {
    let mut from = 0;
    while let Some(i) = body[from..].find('[') {
        let open = from + i;
        from = open + 1;
        let name_len = body[..open]
            .bytes()
            .rev()
            .take_while(|&b| super::codegen::is_ident(b))
            .count();
        let name = &body[open - name_len..open];
        if !local_arrays.contains(name) {
            continue;
        }
        let Some(close) = matching(body, open, b'[', b']') else {
            return true;
        };
        let index = &body[open + 1..close - 1];
        let mut at = 0;
        while let Some(j) = index[at..].find(counter) {
            let s = at + j;
            let e = s + counter.len();
            let before = s == 0 || !super::codegen::is_ident(index.as_bytes()[s - 1]);
            let after = e == index.len() || !super::codegen::is_ident(index.as_bytes()[e]);
            if before && after {
                return true;
            }
            at = e;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(src: &str) {
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{src}\n{e}"));
    }

    #[test]
    fn counted_loops_get_an_opaque_bound_and_local_indexing_keeps_its_own() {
        let src = "var<workgroup> S: array<f32, 64>;
@compute @workgroup_size(8)
fn main(@builtin(local_invocation_index) tid: u32) {
    var acc = array<f32, 4>();
    for (var i = 0u; i < 16u; i++) { S[tid * 8u + i] = 0.0; }
    for (var c = 0u; c < 4u; c++) { acc[c] = S[c]; }
    for (var r = 0u; r < 2u; r++) {
        for (var q = 0u; q < 2u; q += 1u) { acc[r * 2u + q] += 1.0; }
    }
    for (var j = tid; j < 64u; j += 8u) { S[j] = acc[0]; }
    let v = vec4<f32>(acc[0], acc[1], acc[2], acc[3]);
    for (var t = 0u; t < 4u; t++) { S[t] = v[t]; }
}
";
        let out = keep_loops(src).expect("rewrites");
        valid(&out);
        assert!(out.contains("tid: u32, @builtin(num_workgroups) emu_nwg: vec3<u32>)"));
        assert!(out.contains("let emu_zero = emu_nwg.z >> 16u;"));
        assert!(out.contains("i < 16u + emu_zero;"), "{out}");
        assert!(out.contains("j < 64u + emu_zero;"), "{out}");
        // A vector stays in registers without unrolling.
        assert!(out.contains("t < 4u + emu_zero;"), "{out}");
        // acc[c], acc[r * 2u + q]: unrolled as before.
        assert!(out.contains("c < 4u;"), "{out}");
        assert!(out.contains("r < 2u;"), "{out}");
        assert!(out.contains("q < 2u;"), "{out}");
    }

    #[test]
    fn reuses_the_entry_points_workgroup_count_and_leaves_loopless_shaders() {
        let src = "@group(0) @binding(0) var<storage, read_write> d: array<f32>;
@compute @workgroup_size(8)
fn main(@builtin(num_workgroups) nwg: vec3<u32>) {
    for (var i = 0u; i < 3u; i++) { d[i] = 1.0; }
}
";
        let out = keep_loops(src).expect("rewrites");
        valid(&out);
        assert!(out.contains("let emu_zero = nwg.z >> 16u;"));
        assert_eq!(out.matches("num_workgroups").count(), 1);
        let plain = "@compute @workgroup_size(8)\nfn main() {\n}\n";
        assert_eq!(keep_loops(plain).expect("no loops"), plain);
    }
}
