r"""The repository's Markdown stands alone: every link stays inside the repository and
points at a file (and, for ``#anchor``, a heading) that exists.

Anchors are computed as GitHub renders them: the heading's text without markup,
lower-cased, every character dropped that is not a letter, mark, decimal digit,
connector (``_``), space or hyphen (Ruby's ``\p{Word}``), spaces turned into hyphens,
and ``-1``, ``-2`` … appended to repeated headings.  Files are those git would commit
(tracked, or untracked and not ignored); without git, every file under the root outside
hidden and build folders.
"""

from __future__ import annotations

import os
import re
import subprocess
import unicodedata
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "dist", "onnxdiag-report", "zoo", "__pycache__", "node_modules"}

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"  # [text], one nesting level
                         r"\(\s*(<[^>]*>|[^\s()]*)(?:\s+[\"'(][^)]*)?\)")  # (dest "title")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
AUTOLINK = re.compile(r"<((?:[a-zA-Z][a-zA-Z0-9+.-]*:|www\.)[^>\s]*)>")
BARE_URL = re.compile(r"(?<![\w(<\[])(?:https?://|ftp://|www\.)[^\s)>\]]+")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HTML_HREF = re.compile(r"<(?:a|img)\s[^>]*(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")
#: A Markdown file may not cite the project's shared specification, which a clone lacks.
SHARED_CITATION = re.compile(r"\.\./shared/|\bSPEC\.md\b|\bSPEC\b")


def list_files(root: Path = ROOT) -> set[str]:
    """Repository-relative POSIX paths of the files a clone would have."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, check=True).stdout.decode()
        files = {f for f in out.split("\0") if f}
        if files:
            return {f for f in files if (root / f).is_file()}
    except (OSError, subprocess.CalledProcessError):
        pass
    found = set()
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        rel = Path(folder).relative_to(root)
        found |= {(rel / n).as_posix() for n in names}
    return found


def slugify(text: str) -> str:
    """GitHub's anchor for a heading whose rendered text is ``text``."""
    kept = (c for c in text.lower()
            if c in " -" or unicodedata.category(c) in ("Nd", "Pc")
            or unicodedata.category(c)[0] in "LM")
    return "".join(kept).replace(" ", "-")


def heading_text(raw: str) -> str:
    """Rendered text of a heading's Markdown: code spans, links, emphasis and tags unwrapped."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = INLINE_LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)


def prose_lines(text: str, *, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; code spans blanked (``blank_code``)."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
        else:
            lines.append((number, CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)
                          if blank_code else line))
    return lines


def anchors_of(text: str) -> set[str]:
    """Every anchor a Markdown document defines (headings, with GitHub's -N for repeats)."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in prose_lines(text, blank_code=False):
        m = HEADING.match(line)
        if m:
            slug = slugify(heading_text(m.group(2)))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
        anchors |= set(HTML_ANCHOR.findall(line))
    return anchors


def links_of(text: str) -> list[tuple[int, str]]:
    """(line number, destination) of every link and image outside code."""
    found = []
    for number, line in prose_lines(text):
        dests = [m.group(2) for m in INLINE_LINK.finditer(line)]
        dests += REF_DEF.findall(line) + AUTOLINK.findall(line) + HTML_HREF.findall(line)
        dests += BARE_URL.findall(INLINE_LINK.sub("", line))
        found += [(number, d[1:-1] if d.startswith("<") and d.endswith(">") else d)
                  for d in dests]
    return found


def check_link(source: str, dest: str, files: set[str], root: Path = ROOT) -> str | None:
    """Why the link ``dest`` in the Markdown file ``source`` is broken, or None if it works."""
    if not dest:
        return "empty link"
    if SCHEME.match(dest) or dest.startswith(("//", "www.")):
        return "leaves the repository"
    path, _, anchor = dest.partition("#")
    path = unquote(path.split("?", 1)[0])
    if path.startswith("/"):
        return "absolute path; use a path relative to the Markdown file"
    if path:
        joined = os.path.normpath(os.path.join(os.path.dirname(source), path))
        target = PurePosixPath(joined.replace(os.sep, "/")).as_posix()
        if target == ".." or target.startswith("../"):
            return "leaves the repository"
        is_dir = target == "." or any(f.startswith(target.rstrip("/") + "/") for f in files)
        if target not in files and not is_dir:
            return f"{target} does not exist in the repository"
    else:
        target = source
    if anchor:
        if target.endswith(".md"):
            if unquote(anchor).lower() not in anchors_of((root / target).read_text("utf-8")):
                return f"no heading gives the anchor #{anchor} in {target}"
        elif not LINE_ANCHOR.match(anchor):
            return f"anchor #{anchor} into a file that is not Markdown"
    return None


def broken_links(root: Path = ROOT) -> list[str]:
    """One line per broken link in every Markdown file of the repository at ``root``."""
    files = list_files(root)
    problems = []
    for md in sorted(f for f in files if f.endswith(".md")):
        for number, dest in links_of((root / md).read_text("utf-8")):
            why = check_link(md, dest, files, root)
            if why:
                problems.append(f"{md}:{number}: ({dest}) {why}")
    return problems


def test_markdown_links_stay_inside_the_repository_and_resolve():
    assert broken_links() == []


def test_markdown_does_not_cite_the_shared_specification():
    files = list_files()
    hits = [f"{md}:{n}: {line.strip()[:80]}" for md in sorted(f for f in files if f.endswith(".md"))
            for n, line in enumerate((ROOT / md).read_text("utf-8").splitlines(), 1)
            if SHARED_CITATION.search(line)]
    assert hits == [], "cite docs/METHODS.md sections instead:\n" + "\n".join(hits)


def test_methods_has_every_section_anchor():
    anchors = anchors_of((ROOT / "docs" / "METHODS.md").read_text("utf-8"))
    sections = [*(f"a{i}" for i in range(1, 6)), *(f"b{i}" for i in range(1, 7)),
                *(f"c{i}" for i in range(1, 6)), "d", "e"]
    missing = [s for s in sections if not any(a.startswith(s + "-") for a in anchors)]
    assert missing == []


@pytest.mark.parametrize("heading, anchor", [
    ("A1 Head gradient", "a1-head-gradient"),
    ("Cost of the RR curves (C2, issue 5 target)", "cost-of-the-rr-curves-c2-issue-5-target"),
    ("Part A — readouts", "part-a--readouts"),
    ("`sample/`: residual CNN, 16 checkpoints", "sample-residual-cnn-16-checkpoints"),
    ("Peer R² and I_X, ½ ln", "peer-r-and-i_x--ln"),
    ("**Bold** and [a link](x.md)", "bold-and-a-link"),
])
def test_slugify_matches_github(heading, anchor):
    assert slugify(heading_text(heading)) == anchor


def test_checker_finds_every_kind_of_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Part A — x\n\n## Twice\n\n## Twice\n")
    (tmp_path / "a.md").write_text(
        "[ok](docs/b.md#title) [ok](docs/b.md#part-a--x) [ok](docs/b.md#twice-1) [ok](#top)\n"
        "# Top\n"
        "[web](https://example.org) <https://example.org/x> see www.example.org\n"
        "[up](../outside.md) [abs](/docs/b.md) [gone](docs/c.md) [anchor](docs/b.md#nope)\n"
        "```\n[in code](https://example.org)\n```\n`[span](https://example.org)`\n")
    problems = broken_links(tmp_path)
    assert len(problems) == 7, problems
    assert sum("leaves the repository" in p for p in problems) == 4
    assert any("docs/c.md does not exist" in p for p in problems)
    assert any("#nope" in p for p in problems)
    assert any("absolute path" in p for p in problems)
