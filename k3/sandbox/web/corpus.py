"""The offline web's pages: the standard library found on this machine, and its HTML documentation.

Three kinds of page, each an HTML document with links to the others (URLs are ``web://py/...``,
a scheme of our own: nothing in it names a host path, and only URLs in the corpus resolve):

  web://py/mod/<module>        a module page: docstring, imports (linked), classes with their bases
                               (linked to the module that defines them) and methods in source order,
                               top-level functions with signatures, UPPER_CASE constants
  web://py/src/<module>        the module's source, numbered lines (anchors #L<n>)
  web://py/docs/<path>.html    a page of the Python HTML documentation (Debian's python3.x-doc),
                               text and links of its body, when that package is installed

Module pages are built from the source with ``ast`` (nothing is imported), so the facts they state
are exactly what the browse tasks (``tasks.py``) are generated from.
"""

from __future__ import annotations

import ast
import html
import os
import re
import sysconfig
from dataclasses import dataclass, field
from html.parser import HTMLParser

URL_PREFIX = "web://py/"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip",
             "lib2to3", "pydoc_data", "__pycache__", "config-3.11-x86_64-linux-gnu", "venv", "unittest/test"}
DOC_SECTIONS = ("library", "tutorial", "reference", "howto", "faq", "using")
MAX_LITERAL = 80


def module_url(name: str) -> str:
    return f"{URL_PREFIX}mod/{name}"


def source_url(name: str) -> str:
    return f"{URL_PREFIX}src/{name}"


@dataclass
class Page:
    """One page: ``text`` is what a reader sees; ``links`` the URLs of the corpus it points to."""

    url: str
    title: str
    html: str
    text: str
    links: list[str] = field(default_factory=list)
    kind: str = "module"  # module | source | doc


@dataclass
class ClassFacts:
    name: str
    bases: list[str]  # as written in the source, e.g. "json.JSONDecoder" or "Mapping"
    base_modules: list[str | None]  # the corpus module each base comes from, when known
    methods: list[str]


@dataclass
class ModuleFacts:
    """What a module page states; the browse tasks are generated from these."""

    name: str
    doc_first_line: str
    imports: list[str]  # stdlib modules of the corpus, in first-import order
    functions: dict[str, list[tuple[str, str | None]]]  # name -> [(parameter, default source or None)]
    classes: dict[str, ClassFacts]
    constants: dict[str, str]  # UPPER_CASE name -> literal as written
    lines: int


@dataclass
class Corpus:
    pages: dict[str, Page]
    modules: dict[str, ModuleFacts]
    source: str  # where it was built from (shown by `k3 sandbox web info`)

    def page(self, url: str) -> Page | None:
        return self.pages.get(url)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def docs_dir() -> str | None:
    """The HTML documentation of some installed Python (Debian's python3.x-doc), or None."""
    base = "/usr/share/doc"
    for name in sorted(os.listdir(base) if os.path.isdir(base) else (), reverse=True):
        candidate = os.path.join(base, name, "html")
        if re.fullmatch(r"python3(\.\d+)?(-doc)?", name) and os.path.isfile(os.path.join(candidate, "library", "index.html")):
            return candidate
    return None


def stdlib_modules(root: str) -> dict[str, str]:
    """module name -> source path for every .py file of the stdlib at ``root`` (tests etc. skipped)."""
    found = {}
    for directory, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(directory, root)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                             and os.path.join(rel_dir, d).lstrip("./") not in SKIP_DIRS and "-" not in d)
        for filename in sorted(filenames):
            if not filename.endswith(".py") or "-" in filename:
                continue
            rel = os.path.relpath(os.path.join(directory, filename), root)[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and all(part.isidentifier() for part in parts):
                found[".".join(parts)] = os.path.join(directory, filename)
    return found


class _Source(str):
    """Source text that finds node segments fast (``ast.get_source_segment`` splits the whole
    source again on every call, which is quadratic over a module)."""

    def segment(self, node: ast.AST) -> str | None:
        if getattr(node, "end_lineno", None) is None:
            return None
        if not hasattr(self, "_starts"):
            starts, position = [0], 0
            for line in self.splitlines(keepends=True):
                position += len(line.encode())
                starts.append(position)
            self._starts, self._bytes = starts, self.encode()
        start = self._starts[node.lineno - 1] + node.col_offset
        end = self._starts[node.end_lineno - 1] + node.end_col_offset
        return self._bytes[start:end].decode(errors="replace")


def _segment(source: str, node: ast.AST) -> str | None:
    return source.segment(node) if isinstance(source, _Source) else ast.get_source_segment(source, node)


def _literal(node: ast.AST, source: str) -> str | None:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    text = _segment(source, node)
    if text is None or len(text) > MAX_LITERAL or "\n" in text:
        return None
    return text


def module_facts(name: str, source: str, known: set[str]) -> ModuleFacts | None:
    """Facts of one module from its source (None when it does not parse)."""
    source = _Source(source)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    package = name if source_is_package(name, known) else name.rpartition(".")[0]
    imports: list[str] = []
    aliases: dict[str, str] = {}  # local name -> module (import x.y as z) or "module:attr" (from m import a)

    def add(module: str) -> None:
        if module in known and module != name and module not in imports:
            imports.append(module)

    for node in tree.body:
        for stmt in ([node] if not isinstance(node, ast.Try) else node.body + [h for hd in node.handlers for h in hd.body]):
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    add(alias.name)
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    anchor = package.split(".") if package else []
                    anchor = anchor[: len(anchor) - (stmt.level - 1)] if stmt.level > 1 else anchor
                    base = ".".join(anchor + ([base] if base else []))
                for alias in stmt.names:
                    if f"{base}.{alias.name}" in known:
                        add(f"{base}.{alias.name}")
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                    else:
                        add(base)
                        aliases[alias.asname or alias.name] = f"{base}:{alias.name}"
    functions: dict[str, list[tuple[str, str | None]]] = {}
    classes: dict[str, ClassFacts] = {}
    constants: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in functions:
            functions[node.name] = _parameters(node.args, source)
        elif isinstance(node, ast.ClassDef) and node.name not in classes:
            bases = [_segment(source, base) or "?" for base in node.bases]
            methods = [item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
            classes[node.name] = ClassFacts(node.name, bases, [_base_module(b, aliases, known) for b in bases], methods)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if re.fullmatch(r"[A-Z][A-Z0-9_]+", target) and target not in constants:
                literal = _literal(node.value, source)
                if literal is not None:
                    constants[target] = literal
    doc = ast.get_docstring(tree) or ""
    first = next((line.strip() for line in doc.splitlines() if line.strip()), "")
    return ModuleFacts(name, first, imports, functions, classes, constants, source.count("\n") + 1)


def source_is_package(name: str, known: set[str]) -> bool:
    prefix = name + "."
    return any(other.startswith(prefix) for other in known)


def _parameters(args: ast.arguments, source: str) -> list[tuple[str, str | None]]:
    positional = args.posonlyargs + args.args
    defaults: list[ast.AST | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, None if d is None else (_segment(source, d) or "?")) for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append(("*" + args.vararg.arg, None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, None if d is None else (_segment(source, d) or "?")))
    if args.kwarg:
        out.append(("**" + args.kwarg.arg, None))
    return out


def _base_module(base: str, aliases: dict[str, str], known: set[str]) -> str | None:
    head, _, attr = base.rpartition(".")
    if head:
        module = aliases.get(head.split(".")[0])
        if module and ":" not in module:
            full = module + head[len(head.split(".")[0]) :]
            return full if full in known else None
        return None
    target = aliases.get(base)
    if target and ":" in target:
        module = target.split(":")[0]
        return module if module in known else None
    return None


def _signature(params: list[tuple[str, str | None]]) -> str:
    return ", ".join(p if d is None else f"{p}={d}" for p, d in params)


def module_page(facts: ModuleFacts, doc: str) -> Page:
    """The HTML page of a module (and its plain text, as a reader sees it)."""
    e = html.escape
    links = [source_url(facts.name)] + [module_url(m) for m in facts.imports]
    parts = [f"<html><head><title>{e(facts.name)}</title></head><body>", f"<h1>Module {e(facts.name)}</h1>",
             f"<p><a href=\"{e(source_url(facts.name))}\">source code</a> ({facts.lines} lines)</p>",
             f"<pre>{e(doc)}</pre>"]
    text = [f"Module {facts.name}", f"Source code: {source_url(facts.name)} ({facts.lines} lines)", "", doc, ""]
    if facts.imports:
        parts.append("<h2>Imports</h2><ul>" + "".join(f"<li><a href=\"{e(module_url(m))}\">{e(m)}</a></li>" for m in facts.imports) + "</ul>")
        text += ["Imports (standard-library modules, in source order):"] + [f"  {m}  <{module_url(m)}>" for m in facts.imports] + [""]
    if facts.classes:
        parts.append("<h2>Classes</h2>")
        text.append("Classes (in source order):")
        for cls in facts.classes.values():
            bases_html = ", ".join(
                f"<a href=\"{e(module_url(m))}\">{e(b)}</a>" if m else e(b) for b, m in zip(cls.bases, cls.base_modules))
            parts.append(f"<h3>class {e(cls.name)}({bases_html})</h3><p>methods: {e(', '.join(cls.methods))}</p>")
            bases_text = ", ".join(f"{b} <{module_url(m)}>" if m else b for b, m in zip(cls.bases, cls.base_modules))
            text.append(f"  class {cls.name}({bases_text})")
            text.append(f"    methods, in source order: {', '.join(cls.methods) if cls.methods else '(none)'}")
            links += [module_url(m) for m in cls.base_modules if m]
        text.append("")
    if facts.functions:
        parts.append("<h2>Functions</h2><ul>" + "".join(f"<li>def {e(n)}({e(_signature(p))})</li>" for n, p in facts.functions.items()) + "</ul>")
        text += [f"Functions ({len(facts.functions)} at top level, in source order):"]
        text += [f"  def {n}({_signature(p)})" for n, p in facts.functions.items()] + [""]
    if facts.constants:
        parts.append("<h2>Constants</h2><ul>" + "".join(f"<li>{e(k)} = {e(v)}</li>" for k, v in facts.constants.items()) + "</ul>")
        text += ["Constants:"] + [f"  {k} = {v}" for k, v in facts.constants.items()] + [""]
    parts.append("</body></html>")
    return Page(module_url(facts.name), f"Module {facts.name}", "\n".join(parts), "\n".join(text),
                list(dict.fromkeys(links)), "module")


def source_page(name: str, source: str) -> Page:
    lines = source.splitlines()
    width = len(str(len(lines)))
    body = "\n".join(f"<span id=\"L{i}\">{i:>{width}}  {html.escape(line)}</span>" for i, line in enumerate(lines, 1))
    page_html = (f"<html><head><title>{html.escape(name)} source</title></head><body><h1>Source of {html.escape(name)}</h1>"
                 f"<p><a href=\"{module_url(name)}\">module page</a></p><pre>{body}</pre></body></html>")
    text = f"Source of module {name} (module page: {module_url(name)})\n" + "\n".join(
        f"{i:>{width}}  {line}" for i, line in enumerate(lines, 1))
    return Page(source_url(name), f"Source of {name}", page_html, text, [module_url(name)], "source")


class _DocParser(HTMLParser):
    """Text and links of the body of a Sphinx page (navigation bars and scripts left out)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.text: list[str] = []
        self.hrefs: list[str] = []
        self._depth = 0  # >0 inside the body div
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "title":
            self._in_title = True
        if self._depth:
            self._depth += tag == "div"
            if tag in ("script", "style"):
                self._skip += 1
            if tag == "a" and attrs.get("href"):
                self.hrefs.append(attrs["href"])
            if tag in ("p", "li", "h1", "h2", "h3", "h4", "pre", "dt", "dd", "tr", "br"):
                self.text.append("\n")
        elif tag == "div" and attrs.get("role") == "main":
            self._depth = 1

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        if self._depth:
            if tag == "div":
                self._depth -= 1
            if tag in ("script", "style"):
                self._skip -= 1

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif self._depth and not self._skip:
            self.text.append(data)


def doc_pages(root: str) -> list[Page]:
    """Pages of the HTML documentation under ``root`` (sections in ``DOC_SECTIONS``)."""
    pages = []
    for section in DOC_SECTIONS:
        directory = os.path.join(root, section)
        for filename in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
            if not filename.endswith(".html"):
                continue
            rel = f"{section}/{filename}"
            with open(os.path.join(directory, filename), encoding="utf-8", errors="replace") as f:
                document = f.read()
            # html.parser is slow: feed it the title and the main body only, not the navigation.
            main = document.find('role="main"')
            head_end = document.find("</head>")
            parser = _DocParser()
            if main > 0 and head_end > 0:
                body_start = document.rfind("<div", 0, main)
                footer = document.find('<div class="sphinxsidebar"', main)
                parser.feed(document[:head_end] + document[body_start : footer if footer > 0 else len(document)])
            else:
                parser.feed(document)
            text = re.sub(r"\n\s*\n+", "\n\n", "".join(parser.text)).strip()
            links = []
            for href in parser.hrefs:
                target = href.split("#")[0]
                if not target or "://" in target or target.startswith(("mailto:", "/")):
                    continue
                resolved = os.path.normpath(os.path.join(section, target))
                if not resolved.startswith("..") and resolved.endswith(".html"):
                    links.append(f"{URL_PREFIX}docs/{resolved}")
            title = parser.title.strip()
            if title.endswith("documentation") and " \u2014 " in title:
                title = title.rsplit(" \u2014 ", 1)[0]  # drop "- Python 3.x documentation"
            title = title.replace("\u00b6", "").strip() or rel
            url = f"{URL_PREFIX}docs/{rel}"
            pages.append(Page(url, title, f"<html><head><title>{html.escape(title)}</title></head><body><pre>"
                              f"{html.escape(text)}</pre></body></html>", text, list(dict.fromkeys(links)), "doc"))
    return pages


def build_corpus(modules: list[str] | None = None, docs: str | None | bool = True, root: str | None = None) -> Corpus:
    """Build the corpus. modules: names to include (default: the whole stdlib at ``root``, which
    defaults to this interpreter's); docs: a documentation directory, True to look for one, or
    False/None for none."""
    root = root or stdlib_dir()
    found = stdlib_modules(root)
    if modules is not None:
        missing = [m for m in modules if m not in found]
        if missing:
            raise ValueError(f"not standard-library modules under {root}: {missing}")
        found = {m: found[m] for m in modules}
    known = set(found)
    pages: dict[str, Page] = {}
    facts_by_name: dict[str, ModuleFacts] = {}
    for name, path in found.items():
        with open(path, encoding="utf-8", errors="replace") as f:
            source = f.read()
        facts = module_facts(name, source, known)
        if facts is None:
            continue
        try:
            doc = ast.get_docstring(ast.parse(source)) or "(no module docstring)"
        except (SyntaxError, ValueError):
            doc = ""
        facts_by_name[name] = facts
        for page in (module_page(facts, doc), source_page(name, source)):
            pages[page.url] = page
    docs_root = docs_dir() if docs is True else (docs or None)
    if docs_root:
        for page in doc_pages(docs_root):
            page.links = [link for link in page.links if link.startswith(f"{URL_PREFIX}docs/")]
            pages[page.url] = page
    known_urls = set(pages)
    for page in pages.values():
        page.links = [link for link in page.links if link in known_urls]
    return Corpus(pages, facts_by_name, f"stdlib {root}" + (f"; docs {docs_root}" if docs_root else ""))
