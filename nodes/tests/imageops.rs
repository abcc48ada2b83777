use sdkit_nodes::imageops::*;

#[test]
fn smoke() {
    let img = Tensor4::filled(1, 4, 4, 3, 0.5).expect("shape");
    let out = upscale(&img, 7, 5, UpscaleMethod::Bilinear, Crop::Disabled).expect("upscale");
    assert_eq!(out.shape(), [1, 5, 7, 3]);
}
