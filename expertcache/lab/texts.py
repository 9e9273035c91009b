"""A user's text as the lab reads it: UTF-8 text cut into domains (topic changes) by character
offsets, or by the segments file beside it (`eval.json` beside the built-in `eval.txt`), or
one domain of the whole text."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput


@dataclass(frozen=True)
class Segment:
    """One domain of a text: `chars` characters from `start_char`."""
    domain: str
    start_char: int
    chars: int


MAX_TEXT_BYTES = 2**30  # wikitext-103's training text is half of it; /dev/zero or `yes` would fill the memory


def read_bounded(f, source: str) -> bytes:
    """The bytes of the binary stream `f` (a file, a pipe, stdin) to its end; BadInput naming `source` as soon as
    they are binary (a NUL) or once past MAX_TEXT_BYTES, where a device or an endless pipe was read until the
    memory ran out."""
    chunks, size = [], 0
    while chunk := f.read(2**24):
        if b"\0" in chunk:
            utf8_text(chunk, source)  # its message for binary
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_TEXT_BYTES:
            raise BadInput(f"{source} goes on past {MAX_TEXT_BYTES / 2**20:,.0f} MiB; give a shorter text, e.g. its "
                           "start, whole characters kept: head -c 100M FILE | iconv -c -f UTF-8 -t UTF-8 > part.txt")
    return b"".join(chunks)


def read_text(path: Path) -> str:
    """The text of a UTF-8 file as it is (line ends included: \r\n stays, as a tokenizer or a server sees it),
    less a leading byte-order mark, which editors write and do not show (it would be scored as a token, and
    shift the character offsets a user counts for --domains); BadInput naming the file when it is missing,
    unreadable, not UTF-8, blank or endless."""
    try:
        with open(path, "rb") as f:
            data = read_bounded(f, str(path))
    except FileNotFoundError:
        stdin = "; a text is read from a file, not stdin: save it to one" if str(path) == "-" else ""
        raise BadInput(f"{path}: no such text file; give a UTF-8 text file{stdin}") from None
    except OSError as e:  # a folder, no permission
        raise BadInput(f"cannot read text {path} ({e.strerror}); give a UTF-8 text file") from None
    text = utf8_text(data, str(path))
    if not text.strip():
        raise BadInput(f"{path} holds no text; give a UTF-8 text file with the text to run")
    return text


def utf8_text(data: bytes, source: str) -> str:
    """UTF-8 bytes as text, less a leading byte-order mark; BadInput naming `source` (a file, stdin) when they are
    UTF-16 or binary (UTF-16's ASCII decodes as UTF-8, a NUL beside each character: a text of NULs, run silently)
    or not UTF-8."""
    if b"\0" in data or data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise BadInput(f"{source} is UTF-16 or binary, not UTF-8 text (NUL bytes, or a UTF-16 byte-order mark); "
                       "convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{source} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None


def text_segments(path: Path, offsets: tuple[int, ...] | None = None) -> tuple[str, list[Segment]]:
    """The text of `path` and its domains: split at `offsets` (character offsets of topic changes,
    increasing, inside the text) when given; else the segments of `path.with_suffix('.json')`
    ({"segments": [{"domain", "start_char", "chars"}]}) when that file exists; else one domain."""
    path = Path(path)
    text = read_text(path)
    if offsets:
        bounds = [0, *offsets, len(text)]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise BadInput(f"domain offsets {','.join(map(str, offsets))} must increase strictly within the "
                           f"{len(text)} characters of {path}; e.g. --domains {len(text) // 2}")
        return text, [Segment(f"{path.stem}:{i}", a, b - a) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    segments_file = path.with_suffix(".json")
    if (listed := _segments_listed(segments_file)) is not None:
        try:
            segments = [Segment(str(s["domain"]), int(s["start_char"]), int(s["chars"])) for s in listed]
        except (ValueError, KeyError, TypeError) as e:
            raise BadInput(f"{segments_file}: not a segments file ({e}); correct it, remove it, or give "
                           "--domains") from None
        for s in segments:  # a segment past the text would be an empty domain, scored as nothing
            if s.start_char < 0 or s.chars <= 0 or s.start_char + s.chars > len(text):
                raise BadInput(f"{segments_file}: segment {s.domain!r} (start_char {s.start_char}, chars {s.chars}) "
                               f"is not inside the {len(text)} characters of {path}; correct it, remove the file, "
                               "or give --domains")
        if not segments:
            raise BadInput(f"{segments_file} lists no segments; remove it, or give --domains")
        return text, segments
    return text, [Segment(path.stem, 0, len(text))]


def _segments_listed(path: Path):
    """The "segments" a JSON object at `path` lists with their start_char, or None where there is none (no file, or
    another file beside the text: a `ppl --json` of it, a transcript's segments, JSON Lines)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    listed = data.get("segments") if isinstance(data, dict) else None
    ours = isinstance(listed, list) and any(isinstance(s, dict) and "start_char" in s for s in listed)
    return listed if ours or listed == [] else None


def domain_texts(path: Path, offsets: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
    """(domain, text) of each domain of `path` (text_segments)."""
    text, segs = text_segments(path, offsets)
    return [(s.domain, text[s.start_char:s.start_char + s.chars]) for s in segs]
