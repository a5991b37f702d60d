"""The project speaks of itself in dates, commits, machine types and descriptive names, and its docs hold together.

`test_no_private_counters`: no tracked text file names a working session by its number (alone or as a range) or a
training run by a numbered code name; a reader outside the project cannot look those up, while a date, a commit id
or "the drafter shipped 2026-12-05" they can.  The patterns and the examples that test them are built from pieces,
so that this file does not match them itself.

`test_results_pages_and_links`: docs/results holds at most 10 pages, and every relative link in README.md and
docs/**/*.md points at a file or folder that exists.

Both read the files `git ls-files` lists (text only), so they take well under a second.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_SUFFIXES = (".safetensors", ".gguf", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".bin", ".npy", ".npz", ".tgz",
                 ".gz", ".zip", ".so", ".o")
_S, _R = "sess" + "ion", "rec" + "ipe"
COUNTER_WORDS = re.compile(
    rf"{_S}[ _-]?[0-9]|{_S}s? [0-9]+(-[0-9]+)?|{_R}[ _-]?[0-9]+", re.IGNORECASE)
MAX_RESULTS_PAGES = 10
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary, missing or non-UTF-8 file."""
    if path.suffix.lower() in SKIP_SUFFIXES or not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def counter_words(files: list[str]) -> list[str]:
    """'path:line: match' for every line of the given tracked files that names a session or a run by number."""
    hits = []
    for name in files:
        text = text_of(ROOT / name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in COUNTER_WORDS.finditer(line):
                hits.append(f"{name}:{number}: {match.group(0)!r}")
    return hits


def test_no_private_counters():
    hits = counter_words(tracked_files())
    assert not hits, f"{len(hits)} lines name a session or a run by number:\n" + "\n".join(hits)


def test_counter_pattern_catches_the_forms_it_names():
    for word in (f"{_S} 47", f"{_S.title()}s 43-45", f"{_S}s 43", f"{_S}_52", f"{_S}-5", f"{_R}20",
                 f"{_R.upper()} 17", f"{_R}_3", f"bench-{_R}12-a", f"bench-{_S}46"):
        assert COUNTER_WORDS.search(word), word
    for word in ("a session of two cores", "the recipe of the shipped drafter", "sessions per day", "recipes"):
        assert not COUNTER_WORDS.search(word), word


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked (their newlines kept, so line numbers hold):
    `E[tau](K)` in a formula is not a link."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    text = re.sub(r"^```.*?^```", keep_lines, text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`]*`", keep_lines, text)


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) for every relative Markdown link of the page (no scheme, no pure #anchor)."""
    links = []
    for number, line in enumerate(without_code(page.read_text(encoding="utf-8")).splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue
            links.append((number, target.split("#", 1)[0]))
    return links


def test_results_pages_and_links():
    files = tracked_files()
    results = [f for f in files if f.startswith("docs/results/") and f.endswith(".md") and f.count("/") == 2]
    assert len(results) <= MAX_RESULTS_PAGES, f"docs/results holds {len(results)} pages: {sorted(results)}"
    pages = [f for f in files if f == "README.md" or (f.startswith("docs/") and f.endswith(".md"))]
    broken = []
    for name in pages:
        page = ROOT / name
        if not page.is_file():
            continue
        for number, target in relative_links(page):
            if not (page.parent / target).exists():
                broken.append(f"{name}:{number}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)
