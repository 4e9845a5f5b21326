"""Every relative link in README.md and docs/ resolves: the file exists and, for a `#anchor`, the
target has a heading of that anchor (GitHub's rule). Benchmark files move and get removed as
reruns supersede them (docs/bench/README.md); a link left behind fails here, not on a reader."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target), ![alt](target), [![alt](a)](b)
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def markdown_files():
    files = [os.path.join(ROOT, "README.md")]
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".md")]
    return files


def _unfenced(path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if _FENCE.match(line):
                fenced = not fenced
            elif not fenced:
                yield number, line


def _prose_lines(path):
    """(line number, text) outside fenced code blocks, with inline code spans removed."""
    for number, line in _unfenced(path):
        yield number, _CODE_SPAN.sub("", line)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading.strip().lstrip("#").strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path):
    return {anchor(text) for _, text in _heading_lines(path)}


def _heading_lines(path):
    for number, line in _unfenced(path):
        if re.match(r"#{1,6} ", line):
            yield number, line


def broken_links():
    broken = []
    for path in markdown_files():
        for number, line in _prose_lines(path):
            for target in _LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                file_part, _, fragment = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
                    if file_part else path
                where = f"{os.path.relpath(path, ROOT)}:{number}: {target}"
                if not os.path.exists(dest):
                    broken.append(f"{where} (no such file)")
                elif fragment and dest.endswith(".md") and fragment not in anchors(dest):
                    broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_anchor_follows_github():
    assert anchor("## Planner predictions: Llama-3.1-8B on 80 GB GPUs") == \
        "planner-predictions-llama-31-8b-on-80-gb-gpus"
    assert anchor("### With `--use-torch-fsdp2`") == "with---use-torch-fsdp2"


def test_relative_links_resolve():
    assert broken_links() == []
