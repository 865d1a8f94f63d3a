"""Keep benchmarks/results small: every recording there over 16 KB (.jsonl, .json, .log, .txt) is
stored gzipped, byte for byte the same once unpacked (`gzip -dk FILE.gz`, or read as it is:
`specdec replay`, `specdec bench --report-only --out DIR` and bench.harness.read_results read a
results.jsonl.gz where there is no results.jsonl), and every plot is stored with a palette of 256
colours (matplotlib's lines and text look the same; a third of the bytes). Run it after adding a
results folder; tests/test_results.py holds the folder to its size.

    python benchmarks/pack_results.py            # pack what is over the size, print what changed
    python benchmarks/pack_results.py --check    # list what would be packed, change nothing
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PACKED_SUFFIXES = (".jsonl", ".json", ".log", ".txt")
OVER_BYTES = 16 * 1024


def to_pack(root: Path = RESULTS) -> list[Path]:
    """The recordings over OVER_BYTES still stored plain."""
    return sorted(path for path in root.rglob("*") if path.is_file() and path.suffix in PACKED_SUFFIXES
                  and path.stat().st_size > OVER_BYTES)


def pack(path: Path) -> Path:
    """path -> path.gz (mtime 0 and no name inside, so packing the same bytes gives the same file)."""
    packed = path.with_name(path.name + ".gz")
    with open(packed, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as out:
        out.write(path.read_bytes())
    path.unlink()
    return packed


def plots_to_pack(root: Path = RESULTS) -> list[Path]:
    """The plots still stored in full colour."""
    from PIL import Image

    return sorted(path for path in root.rglob("*.png") if Image.open(path).mode != "P")


def pack_plot(path: Path) -> None:
    from PIL import Image

    image = Image.open(path).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
    image.save(path, "PNG", optimize=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="list what would be packed; change nothing")
    args = parser.parse_args()
    paths = to_pack()
    for path in paths:
        before = path.stat().st_size
        if args.check:
            print(f"would pack {path.relative_to(RESULTS)} ({before:,} bytes)")
            continue
        packed = pack(path)
        print(f"{path.relative_to(RESULTS)}: {before:,} -> {packed.stat().st_size:,} bytes")
    plots = plots_to_pack()
    for path in plots:
        before = path.stat().st_size
        if not args.check:
            pack_plot(path)
        print(f"{'would pack ' if args.check else ''}{path.relative_to(RESULTS)}: {before:,} bytes"
              + ("" if args.check else f" -> {path.stat().st_size:,}"))
    return 1 if args.check and (paths or plots) else 0


if __name__ == "__main__":
    raise SystemExit(main())
