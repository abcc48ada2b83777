//! LoadImage's fingerprint: replacing the file re-runs it (and what depends
//! on it); an untouched file is served from the cache.

use sdkit_engine::event::discard;
use sdkit_engine::{validate, CancelToken, Executor, Paths, RunOptions};
use std::sync::Arc;

fn write_png(path: &std::path::Path, v: u8) {
    let img = image::RgbImage::from_pixel(4, 3, image::Rgb([v, v, v]));
    img.save(path).expect("save png");
}

#[test]
fn replaced_input_file_reruns_load_image() {
    let base = tempfile::tempdir().expect("tempdir");
    let paths = Paths::under(base.path());
    std::fs::create_dir_all(&paths.input).expect("mkdir");
    write_png(&paths.input.join("a.png"), 10);
    let lib = Arc::new(sdkit_nodes::library());
    let text = r#"(nodes: {
        "load": LoadImage(image: "a.png"),
        "inv": ImageInvert(image: ("load", 0)),
        "save": SaveImage(images: ("inv", 0), filename_prefix: "x"),
    })"#;
    let wf = sdkit_schema::workflow::load(text, &lib.registry).expect("loads");
    let graph = validate(&wf, &lib.registry, &paths).expect("valid");
    let exec = Executor::new(lib, Arc::new(paths.clone()));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let run = || {
        rt.block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new())))
            .expect("runs")
    };
    assert_eq!(run().executed, ["load", "inv", "save"]);
    assert!(run().executed.is_empty());
    write_png(&paths.input.join("a.png"), 200);
    assert_eq!(run().executed, ["load", "inv", "save"]);
    let out = image::open(paths.output.join("x_00002_.png"))
        .expect("second output")
        .to_rgb8();
    // 255 * (1 - 200/255) is 54.99999 in f32, and SaveImage truncates.
    assert_eq!(out.get_pixel(0, 0).0, [54, 54, 54]);
}
