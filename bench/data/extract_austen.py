"""Extract chapters 1-3 of Pride and Prejudice from Debian's r-cran-janeaustenr package
(how bench/data/pride_and_prejudice_ch1-3.txt was made; see README.md beside this file).

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python bench/data/extract_austen.py pkg/usr/lib/R/site-library/janeaustenr > OUT.txt

The package keeps each novel as an R character vector (one element per line) in R's lazy-load
database: data/Rdata.rdb holds zlib streams after a 4-byte length, at the offsets listed in
data/Rdata.rdx; each stream is R's XDR serialization of a STRSXP of CHARSXPs.
"""

from __future__ import annotations

import struct
import sys
import zlib

# (offset, length) of "prideprejudice" in janeaustenr 1.0.0's data/Rdata.rdx
PRIDE_AND_PREJUDICE = (0x103B3E, 0x422BD)


def novel_lines(package_dir: str, where: tuple[int, int] = PRIDE_AND_PREJUDICE) -> list[str]:
    """The novel's lines, as the package stores them."""
    offset, length = where
    with open(f"{package_dir}/data/Rdata.rdb", "rb") as f:
        f.seek(offset)
        raw = zlib.decompress(f.read(length)[4:])
    if raw[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    pos = 2 + 12  # format, version, writer's and reader's R versions
    (encoding_len,) = struct.unpack(">i", raw[pos : pos + 4])
    pos += 4 + encoding_len
    flags, count = struct.unpack(">ii", raw[pos : pos + 8])
    pos += 8
    if flags & 0xFF != 16:  # STRSXP
        raise ValueError(f"expected a character vector, got SEXP type {flags & 0xFF}")
    lines = []
    for _ in range(count):
        _, n = struct.unpack(">ii", raw[pos : pos + 8])  # CHARSXP flags, byte length
        pos += 8
        lines.append("" if n < 0 else raw[pos : pos + n].decode("utf-8"))
        pos += max(n, 0)
    return lines


def main() -> int:
    text = "\n".join(novel_lines(sys.argv[1]))
    sys.stdout.write(text[: text.index("Chapter 4")].rstrip() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
