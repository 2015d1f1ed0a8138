"""English Wikipedia text for perplexity, read offline from the test data of the ``gensim`` wheel.

``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`` is a
shortened dump of the first English Wikipedia pages (ids 10 to 30302, April 2016: Anarchism, Autism,
Albedo, Abraham Lincoln, Aristotle, ...). :func:`articles` reads it (bz2, then the XML's ``<page>``
elements), keeps the articles (namespace 0, no redirects) and strips their wiki markup with
:func:`strip_markup`. The split is fixed by each article's place in the file:

- :func:`held_out`: every fourth article (places 3, 7, 11, ... counting from 0): the text perplexity is
  measured on;
- :func:`training`: the other three in four: text for recovery or training, disjoint from the first.

Nothing is downloaded: ``pip install multihead[eval]`` installs gensim (found, not imported).
"""

from __future__ import annotations

import bz2
import functools
import html
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

from ..core.checks import check_int
from .data import data_dir

__all__ = [
    "WIKI_FILE",
    "Article",
    "articles",
    "excerpt",
    "held_out",
    "held_out_texts",
    "strip_markup",
    "training",
]

#: the dump's file name in gensim's test data
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
#: one article in this many is held out (:func:`held_out`)
HELD_OUT_EVERY = 4
#: articles whose stripped text is shorter than this (stubs, lists reduced to nothing) are left out
MIN_CHARS = 200

# sections that hold citations and links rather than prose: an article's text ends at the first one
_BACK_MATTER = re.compile(
    r"^==+\s*(references|notes|see also|external links|further reading|bibliography|sources|"
    r"footnotes|citations)\s*==+\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_COMMENT = re.compile(r"<!--.*?(-->|\Z)", re.DOTALL)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?(</ref\s*>|\Z)", re.DOTALL | re.IGNORECASE)
# tags whose content is not prose (formulas, galleries, code, scores)
_DROPPED = re.compile(
    r"<(math|gallery|timeline|syntaxhighlight|source|score|chem|imagemap|hiero)\b[^>]*>.*?(</\1\s*>|\Z)",
    re.DOTALL | re.IGNORECASE,
)
_TAG = re.compile(r"</?[a-zA-Z][^<>]*/?>")
_EXTERNAL = re.compile(r"\[(?:https?|ftp)://[^\s\]]+(?:\s+([^\]]*))?\]")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^=+[^=\n].*?=+\s*$", re.MULTILINE)
# links to files, categories and other-language articles vanish; any other [[target|text]] is its text
_NOT_PROSE_LINK = re.compile(r"^\s*:?\s*(file|image|media|category|[a-z]{2,3}(-[a-z]+)?)\s*:", re.IGNORECASE)


class Article(NamedTuple):
    """One article of the dump: its title and its text with the markup stripped."""

    title: str
    text: str


def _matching(text: str, start: int, open_: str, close: str, others: tuple[tuple[str, str], ...] = ()) -> int:
    """The index just past the ``close`` that balances the ``open_`` at ``start`` (nested ``open_`` and
    the openers of the ``others`` (opener, closer) pairs counted), or -1 when the text ends first."""
    stack = [close]
    closers = dict(others) | {open_: close}
    i = start + len(open_)
    while i < len(text):
        if text.startswith(stack[-1], i):
            i += len(stack.pop())
            if not stack:
                return i
            continue
        opener = next((o for o in closers if text.startswith(o, i)), None)
        if opener is not None:
            stack.append(closers[opener])
            i += len(opener)
        else:
            i += 1
    return -1


def _remove_blocks(text: str) -> str:
    """Templates ``{{...}}`` and tables ``{|...|}`` removed, nested ones included; an opener that never
    closes is dropped by itself (the text after it stays)."""
    pairs = (("{{", "}}"), ("{|", "|}"))
    out, i = [], 0
    while True:
        j = min((k for k in (text.find("{{", i), text.find("{|", i)) if k >= 0), default=-1)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        open_, close = pairs[0] if text.startswith("{{", j) else pairs[1]
        end = _matching(text, j, open_, close, pairs)
        i = j + 2 if end < 0 else end


def _link_text(inner: str) -> str:
    """What ``[[inner]]`` reads as: nothing for a file, category or language link, else the text after
    the last ``|`` (the target when there is none)."""
    if _NOT_PROSE_LINK.match(inner):
        return ""
    return inner.rsplit("|", 1)[-1].strip()


def _replace_links(text: str) -> str:
    """``[[target|text]]`` -> text and ``[[target]]`` -> target, innermost first (a file caption holds
    links); an unclosed ``[[`` is dropped by itself."""
    out, i = [], 0
    while True:
        j = text.find("[[", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        end = _matching(text, j, "[[", "]]")
        if end < 0:
            i = j + 2
            continue
        out.append(_link_text(_replace_links(text[j + 2 : end - 2])))
        i = end


def _clean_lines(text: str) -> str:
    """List markers and table or rule remnants removed per line; runs of blank lines become one."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"^[*#:;]+\s*", "", line.strip())
        if line.startswith(("|", "!")) or re.fullmatch(r"-{4,}", line):
            continue
        lines.append(re.sub(r"[ \t\u00a0]+", " ", line).strip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def strip_markup(wikitext: str) -> str:
    """Plain text of MediaWiki markup.

    Removed: comments, references (``<ref>...</ref>``, ``<ref/>``), templates ``{{...}}`` and tables
    ``{|...|}`` (nested too), formulas and galleries, other HTML tags (their text kept), headings,
    bold / italic quotes, list markers, and everything from the first back-matter heading (References,
    Notes, See also, External links, Further reading, ...) on. Links become their text: ``[[a|b]]`` ->
    ``b``, ``[[a]]`` -> ``a``, ``[http://x y]`` -> ``y``; links to files, categories and other languages
    vanish. HTML entities are decoded; paragraphs stay separated by one blank line.

    Unbalanced markup (an opener that never closes) loses only the opener, never the text after it.
    """
    back = _BACK_MATTER.search(wikitext)
    text = wikitext[: back.start()] if back else wikitext
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _DROPPED.sub("", text)
    text = _remove_blocks(text)
    text = _replace_links(text)
    text = _EXTERNAL.sub(lambda m: m.group(1) or "", text)
    text = _HEADING.sub("", text)
    text = _TAG.sub("", text)
    text = _EMPHASIS.sub("", text)
    return _clean_lines(html.unescape(text))


def _local(tag: str) -> str:
    """An XML tag without its ``{namespace}``."""
    return tag.rsplit("}", 1)[-1]


def _pages(path: Path) -> list[tuple[str, str]]:
    """(title, wikitext) of every article page in the dump: namespace 0, not a redirect."""
    pages = []
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if _local(elem.tag) != "page":
                continue
            fields = {_local(e.tag): e for e in elem.iter()}
            title = fields["title"].text if "title" in fields else None
            ns = fields["ns"].text if "ns" in fields else None
            body = fields["text"].text if "text" in fields else None
            redirect = "redirect" in fields or (body or "").lstrip().upper().startswith("#REDIRECT")
            if title and ns == "0" and body and not redirect:
                pages.append((title, body))
            elem.clear()  # the dump is read page by page
    return pages


def articles(path: str | Path | None = None) -> list[Article]:
    """The dump's articles in file order, markup stripped (:func:`strip_markup`); redirects, pages
    outside the article namespace and articles under :data:`MIN_CHARS` characters left out.

    Args:
        path: a MediaWiki XML dump (``.bz2``); default the one in gensim's test data (:data:`WIKI_FILE`).

    Raises:
        ImportError: gensim is not installed (the message gives the pip command).
        ValueError: the file is missing or is not a readable bz2 MediaWiki dump (the message names it).
    """
    file = Path(path) if path is not None else data_dir((WIKI_FILE,)) / WIKI_FILE
    if not file.is_file():
        raise ValueError(f"the Wikipedia dump {str(file)!r} does not exist; give a .xml.bz2 MediaWiki dump")
    stat = file.stat()
    return list(_read(str(file), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _read(file: str, mtime_ns: int, size: int) -> tuple[Article, ...]:
    """The stripped articles of ``file``, kept for the file's modification time and size (the split
    functions and the command line read the same dump several times; parsing it takes seconds)."""
    try:
        pages = _pages(Path(file))
    except (OSError, EOFError, ET.ParseError) as e:
        raise ValueError(f"{file!r} is not a readable bz2 MediaWiki XML dump: {e}") from None
    out = (Article(title, strip_markup(body)) for title, body in pages)
    return tuple(a for a in out if len(a.text) >= MIN_CHARS)


def held_out(path: str | Path | None = None) -> list[Article]:
    """The held-out articles: places 3, 7, 11, ... of :func:`articles` (every fourth, from 0)."""
    return [a for i, a in enumerate(articles(path)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]


def training(path: str | Path | None = None) -> list[Article]:
    """The other articles of :func:`articles`: disjoint from :func:`held_out`, for recovery or training."""
    return [a for i, a in enumerate(articles(path)) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]


def excerpt(text: str, max_chars: int) -> str:
    """The start of ``text`` up to ``max_chars`` characters, ending at the last paragraph break inside
    that span (else the last space; else cut at ``max_chars``); the whole text when it is short enough.

    Raises:
        ValueError: max_chars < 1.
    """
    check_int("max_chars", max_chars, 1)
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n\n", " "):
        cut = head.rfind(sep)
        if cut > 0:
            return head[:cut].rstrip()
    return head


def held_out_texts(
    n: int | None = None, max_chars: int | None = None, path: str | Path | None = None
) -> list[str]:
    """The texts of the first ``n`` :func:`held_out` articles (all when None), each cut by
    :func:`excerpt` to ``max_chars`` (whole when None): the fixed perplexity text of ``multihead eval
    --perplexity`` and benchmarks/real_lm.py.

    Raises:
        ValueError: n < 1 or more than the held-out articles; max_chars < 1; as :func:`articles`.
    """
    arts = held_out(path)
    if n is not None:
        check_int("n", n, 1, len(arts), fix=f"there are {len(arts)} held-out articles")
    texts = [a.text for a in arts[:n]]
    return texts if max_chars is None else [excerpt(t, max_chars) for t in texts]
