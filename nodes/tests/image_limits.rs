//! Hostile or unusual inputs to the image and latent nodes: decompression
//! bombs, sizes that cannot fit, animated images, output permissions.

use sdkit_engine::event::discard;
use sdkit_engine::{validate, CancelToken, Executor, NodeError, Paths, RunOptions};
use sdkit_nodes::imagefile::{self, MAX_IMAGE_PIXELS};
use std::path::Path;
use std::sync::Arc;

#[path = "support/png_bomb.rs"]
mod png_bomb;
use png_bomb::write_bomb;

#[test]
fn decompression_bomb_is_refused_from_its_header() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bomb.png");
    write_bomb(&path, 20000);
    let size = std::fs::metadata(&path).expect("written").len();
    assert!(size < 1 << 20, "the bomb is small on disk: {size} bytes");

    let err = imagefile::decode(&path).expect_err("refused").to_string();
    assert!(
        err.contains("bomb.png")
            && err.contains("20000×20000")
            && err.contains(&MAX_IMAGE_PIXELS.to_string()),
        "{err}"
    );
    let err = imagefile::load_tensors(&path, &CancelToken::new()).expect_err("refused");
    assert!(matches!(err, NodeError::File { .. }), "{err}");
    assert!(imagefile::dimensions(&path).is_err());

    // Just under the limit in pixels is still an image (13376² =
    // 178917376 pixels); only its header is read here.
    write_bomb(&path, 13376);
    assert_eq!(
        imagefile::dimensions(&path).expect("allowed"),
        (13376, 13376)
    );
}

/// ComfyUI's LoadImage gives every frame of an animation as a batch.
#[test]
fn animated_gif_loads_every_frame() {
    use image::{codecs::gif::GifEncoder, Delay, Frame, Rgba, RgbaImage};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("anim.gif");
    let colors = [[255, 0, 0], [0, 255, 0], [0, 0, 255]];
    {
        let file = std::fs::File::create(&path).expect("create");
        let mut enc = GifEncoder::new(file);
        let frames = colors.iter().map(|&[r, g, b]| {
            let img = RgbaImage::from_pixel(4, 3, Rgba([r, g, b, 255]));
            Frame::from_parts(img, 0, 0, Delay::from_numer_denom_ms(100, 1))
        });
        enc.encode_frames(frames).expect("encode");
    }
    let (image, mask) = imagefile::load_tensors(&path, &CancelToken::new()).expect("loads");
    assert_eq!(image.shape, [3, 3, 4, 3]);
    // Opaque frames: ComfyUI's 64×64 zero masks, one per frame.
    assert_eq!(mask.shape, [3, 64, 64]);
    for (i, c) in colors.iter().enumerate() {
        let first = &image.data[i * 36..i * 36 + 3];
        let want: Vec<f32> = c.iter().map(|&v| f32::from(v) / 255.0).collect();
        assert_eq!(first, want.as_slice(), "frame {i}");
    }

    // A still image is one frame, as before.
    let still = dir.path().join("still.png");
    image::RgbImage::from_pixel(5, 2, image::Rgb([9, 9, 9]))
        .save(&still)
        .expect("save");
    let (image, mask) = imagefile::load_tensors(&still, &CancelToken::new()).expect("loads");
    assert_eq!(
        (image.shape, mask.shape),
        (vec![1, 2, 5, 3], vec![1, 64, 64])
    );
}

fn run(base: &Path, text: &str) -> Result<sdkit_engine::RunReport, sdkit_engine::RunError> {
    let paths = Paths::under(base);
    std::fs::create_dir_all(&paths.input).expect("mkdir");
    let lib = Arc::new(sdkit_nodes::library());
    let wf = sdkit_schema::workflow::load(text, &lib.registry).expect("loads");
    let graph = validate(&wf, &lib.registry, &paths).expect("valid");
    let exec = Executor::new(lib, Arc::new(paths));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(exec.run(&graph, RunOptions::new(discard(), CancelToken::new())))
}

/// A latent no machine can hold (16384² × 4096: 256 GiB) is refused from
/// the node's estimate before anything is allocated.
#[test]
fn latent_larger_than_memory_is_refused_before_it_runs() {
    let base = tempfile::tempdir().expect("tempdir");
    let text = r#"(nodes: {
        "empty": EmptyLatentImage(width: 16384, height: 16384, batch_size: 4096),
        "save": SaveLatent(samples: ("empty", 0), filename_prefix: "x"),
    })"#;
    let err = run(base.path(), text).expect_err("refused").to_string();
    assert!(
        err.contains("not enough memory") && err.contains("256.0 GiB"),
        "{err}"
    );
}

/// SaveLatent's atomic write gives the file the same mode as SaveImage's
/// PNGs (0666 less the umask; tempfile alone would make it 0600).
#[cfg(unix)]
#[test]
fn saved_latents_have_the_permissions_of_saved_images() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().expect("tempdir");
    let text = r#"(nodes: {
        "empty": EmptyLatentImage(width: 64, height: 64, batch_size: 1),
        "save": SaveLatent(samples: ("empty", 0), filename_prefix: "lat"),
        "img": EmptyImage(width: 8, height: 8, batch_size: 1, color: 0),
        "png": SaveImage(images: ("img", 0), filename_prefix: "pic"),
    })"#;
    run(base.path(), text).expect("runs");
    let out = base.path().join("output");
    let mode = |f: &str| {
        std::fs::metadata(out.join(f))
            .expect(f)
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("lat_00001_.latent"), mode("pic_00001_.png"));
}
