//! Builds the eBPF object (shaper-ebpf) with nightly and embeds it in the binary.
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let metadata_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shaper-ebpf");
    let root = metadata_dir
        .canonicalize()
        .context("shaper-ebpf directory is missing")?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "shaper-ebpf",
            root_dir: root.to_str().context("non-UTF-8 path")?,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
