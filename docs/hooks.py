"""MkDocs hooks for vitscope's site.

Material's offline plugin adds a script from unpkg.com so that search works on pages opened as
files; a site that must read offline loads nothing remote, so that script is taken out again. Opened
as files, the site reads and navigates fully; search needs it served (`python -m http.server -d site`).

Pages may link to files of the repository outside docs/ (`../benchmarks/RESULTS.md`),
which a view of the Markdown in the repository follows but the site does not hold. On the site such a
link becomes the path as text, so the strict build still fails on every link that is truly broken."""

from __future__ import annotations

import posixpath
import re

_LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)]*)?\)")


def _leaves_docs(page_uri: str, target: str) -> str | None:
    """The repository path `target` points to when it lies outside docs/, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    return resolved[3:] if resolved.startswith("../") else None


def on_config(config):
    polyfills = config.extra.get("polyfills", [])
    config.extra["polyfills"] = [url for url in polyfills if "://" not in url]
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    def rewrite(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        path = _leaves_docs(page.file.src_uri, target)
        if path is None:
            return match.group(0)
        return text if path in text else f"{text} (`{path}` in the repository)"

    return _LINK.sub(rewrite, markdown)
