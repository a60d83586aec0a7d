//! Hostile input to the format parsers: truncated, garbage and lying headers and manifests must
//! give an error, never a panic or a huge allocation.

mod common;

use common::*;
use hotstart_ckpt::format::{self, Layout, MAX_HEADER_LEN, Manifest};
use proptest::prelude::*;

fn sample_file() -> (Vec<u8>, Vec<u8>) {
    let set = sample_tensors(3, 10_000);
    let tensors = to_tensors(&set);
    let layout = Layout::new("job", 5, 1, &tensors).unwrap();
    let mut file = layout.header.clone();
    for (_, _, _, b) in &set {
        file.extend_from_slice(b);
    }
    let hashes: Vec<_> = file.chunks(4096).map(blake3::hash).collect();
    let m = Manifest::new("job", 5, 0, 1, &layout, 4096, &hashes, &extras(1));
    (file, m.to_json())
}

#[test]
fn valid_inputs_parse() {
    let (file, manifest) = sample_file();
    let h = format::parse_header(&file, file.len() as u64, "f").unwrap();
    assert_eq!(h.data_offset % 8, 0);
    let m = Manifest::parse(&manifest, "m").unwrap();
    assert_eq!(m.tensors, h.tensors);
    assert_eq!(m.decode_extras().unwrap(), extras(1));
}

#[test]
fn hostile_header_lengths() {
    let (file, _) = sample_file();
    for n in [
        u64::MAX,
        u64::MAX - 7,
        MAX_HEADER_LEN + 1,
        file.len() as u64,
        file.len() as u64 - 7,
    ] {
        let mut f = file.clone();
        f[..8].copy_from_slice(&n.to_le_bytes());
        assert!(
            format::parse_header(&f, f.len() as u64, "f").is_err(),
            "{n}"
        );
    }
    // Claimed file length shorter than the header.
    assert!(format::parse_header(&file, 100, "f").is_err());
    for cut in [0, 1, 7, 8, 9, 50] {
        assert!(format::parse_header(&file[..cut], file.len() as u64, "f").is_err());
    }
}

#[test]
fn lying_headers() {
    let bad_jsons: &[&str] = &[
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
        r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
        r#"{"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}"#,
        r#"{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,4]}}"#,
        r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}}"#,
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
        r#"{"a":[]}"#,
        r#"[1,2,3]"#,
        r#"{"__metadata__":{"x":1}}"#,
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    ];
    for j in bad_jsons {
        let mut f = (j.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(j.as_bytes());
        f.extend_from_slice(&[0u8; 4]);
        assert!(
            format::parse_header(&f, f.len() as u64, "f").is_err(),
            "{j}"
        );
    }
}

#[test]
fn lying_manifests() {
    let (_, manifest) = sample_file();
    let good: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
    let edits: Vec<(&str, serde_json::Value)> = vec![
        ("format_version", 99.into()),
        ("chunk_size", 0.into()),
        ("chunk_size", 1.into()),
        ("file_len", u64::MAX.into()),
        ("file_len", 3.into()),
        ("data_offset", u64::MAX.into()),
        ("rank", 1.into()),
        ("world_size", 0.into()),
        ("chunks", serde_json::json!(["zz"])),
        ("extras", serde_json::json!({"a": "!!!not base64"})),
        ("extras_encoding", "hex".into()),
        ("file", "../../etc/passwd".into()),
        (
            "tensors",
            serde_json::json!([{"name":"a","dtype":"F32","shape":[1],"data_offsets":[0,8]}]),
        ),
    ];
    for (k, v) in edits {
        let mut m = good.clone();
        m[k] = v.clone();
        let bytes = serde_json::to_vec(&m).unwrap();
        assert!(Manifest::parse(&bytes, "m").is_err(), "{k} = {v}");
    }
    for cut in [0, 1, manifest.len() / 3, manifest.len() - 1] {
        assert!(Manifest::parse(&manifest[..cut], "m").is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn header_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), claim in any::<u64>()) {
        let _ = format::parse_header(&bytes, claim, "f");
        let _ = format::parse_header(&bytes, bytes.len() as u64, "f");
        let _ = format::header_prefix_len(&bytes, claim, "f");
    }

    #[test]
    fn header_parser_with_valid_length_never_panics(json in "\\PC{0,200}", tail in 0usize..64) {
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json.as_bytes());
        f.extend(std::iter::repeat_n(0u8, tail));
        let _ = format::parse_header(&f, f.len() as u64, "f");
    }

    #[test]
    fn manifest_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Manifest::parse(&bytes, "m");
    }

    #[test]
    fn mutated_files_never_panic(pos in 0usize..4096, val in any::<u8>(), mpos in 0usize..4096, mval in any::<u8>()) {
        let (mut file, mut manifest) = sample_file();
        let p = pos % file.len();
        file[p] = val;
        let _ = format::parse_header(&file, file.len() as u64, "f");
        let mp = mpos % manifest.len();
        manifest[mp] = mval;
        if let Ok(m) = Manifest::parse(&manifest, "m") {
            // Whatever parses is self-consistent.
            prop_assert_eq!(m.chunks.len() as u64, m.file_len.div_ceil(m.chunk_size));
        }
    }
}
