"""MkDocs hooks: the site takes ``CHANGELOG.md`` and ``benchmarks/`` (its README, results and plots) from where
they live in the repository, so neither is copied into ``docs/``; a link to another file of the repository that
is not a page (an example, a test) becomes that file's path in code form, since the site cannot serve it.
A link to a file that does not exist stays a link, and the strict build fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
FROM_REPOSITORY = ("CHANGELOG.md", "benchmarks/README.md")
BENCHMARK_RESULTS = "benchmarks/results"
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)#\s]+)(#[^)\s]*)?\)")


def on_files(files: Files, config) -> Files:
    site = config["site_dir"]
    urls = config["use_directory_urls"]
    for path in FROM_REPOSITORY:
        files.append(File(path, str(ROOT), site, urls))
    for result in sorted((ROOT / BENCHMARK_RESULTS).glob("*")):
        if result.suffix in (".md", ".png", ".svg"):
            files.append(File(f"{BENCHMARK_RESULTS}/{result.name}", str(ROOT), site, urls))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    here = Path(page.file.src_uri).parent
    if page.file.src_uri == "CHANGELOG.md":  # its links name pages as docs/<page>.md, from the repository root
        markdown = markdown.replace("](docs/", "](")
    return LINK.sub(lambda m: _link(m, here, files), markdown)


def _link(match: re.Match, here: Path, files: Files) -> str:
    text, target = match.group(1), match.group(2)
    if "://" in target or target.startswith("mailto:"):
        return match.group(0)
    uri = posixpath.normpath((here / target).as_posix())
    if files.get_file_from_path(uri) is not None:
        return match.group(0)
    # docs/ pages sit one folder below the repository root; the other sources sit where they are.
    from_root = uri[3:] if uri.startswith("../") else uri
    if (ROOT / from_root).exists():
        return f"{text} (`{from_root}`)" if text.strip("`") != from_root else f"`{from_root}`"
    return match.group(0)


ROLE = re.compile(r":(?:class|mod|func|meth|attr|obj):<code>~?([\w.]+)</code>")


def on_page_content(html: str, page, config, files: Files) -> str:
    """The docstrings' Sphinx roles (``:class:`~a.B```) shown as code, without the role's name."""
    return ROLE.sub(lambda m: f"<code>{m.group(1)}</code>", html)
