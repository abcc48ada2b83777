//! The example workflows write the pixels ComfyUI writes.
//!
//! References in `tests/reference/` come from `tools/reference/pipelines.py`
//! (PyTorch + Pillow + ComfyUI's own resampling code).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(graph: &str) -> tempfile::TempDir {
    let base = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(base.path().join("input")).expect("mkdir");
    std::fs::copy(
        root().join("graphs/input/example.png"),
        base.path().join("input/example.png"),
    )
    .expect("copy");
    let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q"])
        .arg(root().join(graph))
        .arg("--base-dir")
        .arg(base.path())
        .output()
        .expect("runs");
    assert!(
        o.status.success(),
        "{graph}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    base
}

/// Compares decoded RGB pixels; returns (max abs difference, pixels differing).
fn compare(got: &Path, want: &Path) -> (u8, usize) {
    let g = image::open(got).expect("output decodes").to_rgb8();
    let w = image::open(want).expect("reference decodes").to_rgb8();
    assert_eq!(g.dimensions(), w.dimensions(), "{}", got.display());
    let mut max = 0u8;
    let mut n = 0;
    for (a, b) in g.as_raw().iter().zip(w.as_raw()) {
        let d = a.abs_diff(*b);
        max = max.max(d);
        n += usize::from(d > 0);
    }
    (max, n)
}

#[test]
fn every_form_of_the_image_pipeline_writes_comfyui_pixels() {
    for graph in [
        "graphs/image_pipeline.ron",
        "graphs/image_pipeline.json",
        "graphs/comfy_api_image_pipeline.json",
        "graphs/comfy_ui_image_pipeline.json",
    ] {
        let base = run(graph);
        let (max, n) = compare(
            &base.path().join("output/inverted_00001_.png"),
            &root().join("tests/reference/image_pipeline.png"),
        );
        assert_eq!((max, n), (0, 0), "{graph}: max diff {max} over {n} values");
    }
}

#[test]
fn mask_ops_match_comfyui() {
    let base = run("graphs/mask_ops.ron");
    for (out, reference) in [
        ("output/masks/alpha_00001_.png", "mask_ops_alpha.png"),
        ("output/masks/crop_00001_.png", "mask_ops_crop.png"),
    ] {
        let (max, n) = compare(
            &base.path().join(out),
            &root().join("tests/reference").join(reference),
        );
        // Exact: the f32 convolution sums in PyTorch's order, so even
        // values on a truncation boundary land on the same byte.
        assert_eq!((max, n), (0, 0), "{out}: max diff {max} over {n} values");
    }
}

/// GetImageSize's INT outputs drive another node's widgets: a canvas the
/// size of the input, stitched beside it (64 + 2 + 64 wide).
#[test]
fn image_size_outputs_feed_widgets() {
    let base = run("graphs/image_size.json");
    let out = image::open(base.path().join("output/image_size_00001_.png"))
        .expect("output decodes")
        .to_rgb8();
    assert_eq!(out.dimensions(), (64 + 2 + 64, 48));
    // The canvas is EmptyImage's orange (0xFF8000), the spacing white.
    assert_eq!(out.get_pixel(100, 10).0, [255, 128, 0]);
    assert_eq!(out.get_pixel(64, 10).0, [255, 255, 255]);
}
