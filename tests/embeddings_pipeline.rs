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
