//! A decompression bomb for tests of the image-size limit, shared by
//! `nodes/tests/image_limits.rs` and the root crate's `tests/memory.rs`.

use std::path::Path;

/// A valid 1-bit grayscale PNG of `side`×`side` black pixels, written row
/// by row: 20000² is about 50 KB on disk and would be 1.2 GB as RGB8 and
/// 6.4 GB as IMAGE and MASK tensors.
pub fn write_bomb(path: &Path, side: u32) {
    let file = std::fs::File::create(path).expect("create");
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), side, side);
    enc.set_color(png::ColorType::Grayscale);
    enc.set_depth(png::BitDepth::One);
    enc.set_compression(png::Compression::Fast);
    let mut w = enc
        .write_header()
        .expect("header")
        .into_stream_writer()
        .expect("stream");
    let row = vec![0u8; side.div_ceil(8) as usize];
    for _ in 0..side {
        std::io::Write::write_all(&mut w, &row).expect("row");
    }
    w.finish().expect("finish");
}
