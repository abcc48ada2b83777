//! Textual-inversion embeddings end to end against ComfyUI's nodes
//! (tools/reference/embeddings_pipeline.py →
//! tests/reference/embeddings/expected.json): `embedding:NAME`, with and
//! without the extension, weighted `(embedding:NAME:1.3)`, a trailing
//! comma, multi-vector embeddings moving whole to the next 77-token chunk,
//! a missing embedding dropped, and SDXL's per-encoder `clip_l`/`clip_g`
//! vectors.

mod support;

use support::{check_graph, copy_input, run, write_base_checkpoints, write_fixture_files};

fn matches_on(graph: &str) {
    let fx = support::fixture("embeddings/expected.json");
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    write_fixture_files(&models.join("embeddings"), &fx["embeddings"]);
    copy_input(base.path());
    run(base.path(), graph, "cpu");
    check_graph(base.path(), &fx, graph, None);
}

#[test]
fn sd1_embeddings_match_comfyui() {
    matches_on("tiny_sd1_embeddings");
}

#[test]
fn sdxl_embeddings_match_comfyui() {
    matches_on("tiny_sdxl_embeddings");
}

/// An A1111 `.pt` embedding ({"string_to_param": {"*": vectors}, ...},
/// torch.save's zip layout) is read by the restricted pickle reader and
/// gives the same image as its `.safetensors` form.
#[test]
fn sd1_pt_embedding_matches_comfyui() {
    use sdkit_compute::weights::{DType, SafeTensors};
    use support::torch_save::{write as torch_save, Obj};
    let fx = support::fixture("embeddings/expected.json");
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    write_fixture_files(&models.join("embeddings"), &fx["embeddings"]);
    copy_input(base.path());
    let st_path = models.join("embeddings/tiny_sd1_style.safetensors");
    let file = SafeTensors::open(&st_path).expect("embedding");
    let t = file.tensors().next().expect("a tensor").clone();
    assert_eq!(t.dtype, DType::F16);
    let raw = file.raw(&t.name).expect("raw").to_vec();
    torch_save(
        &models.join("embeddings/tiny_sd1_style.pt"),
        &Obj::Dict(vec![
            (
                "string_to_param",
                Obj::Dict(vec![("*", Obj::Tensor(DType::F16, &t.shape, &raw))]),
            ),
            ("name", Obj::Str("tiny_sd1_style")),
            ("step", Obj::Int(3000)),
        ]),
    );
    drop(file);
    std::fs::remove_file(&st_path).expect("rm");
    run(base.path(), "tiny_sd1_embeddings", "cpu");
    check_graph(base.path(), &fx, "tiny_sd1_embeddings", None);
}
