"""Sphinx configuration of gradpipe's documentation site.

Build it strictly, as CI does::

    sphinx-build -W --keep-going -n -b html docs docs/_build/html

No inventories are fetched (the build runs offline): names from other libraries in
signatures are listed in ``nitpick_ignore_regex`` below instead of linked.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

from sphinx.ext.napoleon.docstring import GoogleDocstring

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gradpipe  # noqa: E402

project = "gradpipe"
author = "gradpipe developers"
copyright = "gradpipe developers"
release = gradpipe.__version__
version = release

extensions = [
    "myst_nb",  # Markdown pages (myst-parser) and the notebook, not executed
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "images/*.py", "**.ipynb_checkpoints"]
templates_path = ["_templates"]

# The notebook is committed with its outputs and executed by tests/test_notebook.py;
# the site renders it as it is.
nb_execution_mode = "off"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4

html_theme = "pydata_sphinx_theme"
html_title = f"gradpipe {release}"
html_theme_options = {
    "navigation_depth": 3,
    "show_toc_level": 2,
    "navbar_align": "left",
}

# The API reference: every public name as gradpipe.X (where it is defined is an
# implementation detail that moves); viewcode follows each to its source.
autosummary_generate = True
autosummary_imported_members = True
# A module documents what its __all__ lists, not what it happens to import.
autosummary_ignore_module_all = False
autodoc_inherit_docstrings = False
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# Types in numpydoc sections ("int, optional") are text, not cross-references.
napoleon_use_param = False
napoleon_use_ivar = True
viewcode_follow_imported_members = True

nitpicky = True
# Types from other libraries appear in signatures; without network access there are no
# inventories to link them to. Everything from gradpipe itself must resolve.
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|numcodecs|xarray|xr|dask|distributed|fsspec|torch|pandas)(\..*)?"),
    (r"py:.*", r"(collections|typing|typing_extensions|types|os|pathlib|io|enum)(\..*)?"),
    (r"py:.*", r"(concurrent|datetime|argparse|threading|json|contextlib|dataclasses|abc)(\..*)?"),
    (r"py:class", r"(int|float|str|bytes|bool|object|None|dict|list|tuple|set|frozenset)"),
    (r"py:class", r"(Any|Iterator|Iterable|Mapping|Sequence|Callable|Literal|Self|Final)"),
    (r"py:class", r"(ArrayLike|DTypeLike|NDArray|PathLike|Future|Client)"),
    (r"py:class", r"(Dataset|DataArray|DataTree)"),
    (r"py:class", r"(matplotlib|botocore|s3fs|safetensors|prometheus_client)(\..*)?"),
    (r"py:class", r"(Figure|DaskArray|Codec|Scheduler|T_PathFileOrDataStore)"),
]


def _lookup(path: str) -> tuple[bool, object]:
    """Import ``a.b.C.d``: (True, the object) if it exists, else (False, None)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            annotations = getattr(obj, "__annotations__", {})
            if hasattr(obj, part):
                obj = getattr(obj, part)
            elif part in fields or part in annotations:  # a field without a class default
                return True, None
            else:
                return False, None
        return True, obj
    return False, None


def _documented(env) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """id(object) -> the name the reference documents it under (gradpipe.X, gradpipe.xarray.Y)."""
    index = env.app.__dict__.setdefault("_gradpipe_documented", {})
    if not index:
        for fullname in env.get_domain("py").objects:
            found, obj = _lookup(fullname)
            if found and obj is not None:
                index.setdefault(id(obj), fullname)
    return index


def _resolve_gradpipe(app, env, node, contnode):  # type: ignore[no-untyped-def]
    """Resolve references to gradpipe's own names, wherever they are defined.

    Annotations and docstrings name objects where they are defined
    (``gradpipe.storage.verify.verify``); the reference documents the public name
    (``gradpipe.verify``): link there. A name that exists but is internal (not in the
    reference) is shown as text. A name that does not exist stays unresolved, so the
    strict build fails on it.
    """
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates += [f"{module}.{cls}.{target}"] if cls else []
        candidates.append(f"{module}.{target}")
    # A docstring's references are relative to the module that defines it, which is not
    # the module the reference documents it under (generated/gradpipe.snapshot).
    page = node["refdoc"].rpartition("/")[2]
    found, obj = _lookup(page) if page.startswith("gradpipe") else (False, None)
    defining = getattr(obj, "__module__", None) if found else None
    if isinstance(obj, types.ModuleType):  # gradpipe.snapshot is also a module
        defining = obj.__name__
    if defining:
        candidates.append(f"{defining}.{target}")
        if isinstance(obj, type):
            candidates.append(f"{defining}.{obj.__name__}.{target}")
    candidates.append(f"gradpipe.{target}")
    for candidate in candidates:
        if not candidate.startswith("gradpipe"):
            continue
        found, obj = _lookup(candidate)
        if not found:
            continue
        public = _documented(env).get(id(obj)) if obj is not None else None
        if public is not None:
            return env.get_domain("py").resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
            )
        return contnode  # it exists, and is internal: text, not a link
    return None


def _inline_attribute_without_type(self):  # type: ignore[no-untyped-def]
    """Read a property's docstring as text: never "type: description" (a Google-style form).

    gradpipe's docstrings are numpydoc; "Where the dump came from: path, ..." is a sentence,
    and its type is the annotation.
    """
    return "", self.__class__(self._consume_to_end(), self._config).lines()


GoogleDocstring._consume_inline_attribute = _inline_attribute_without_type


def _factory_defaults(app, what, name, obj, options, signature, return_annotation):  # type: ignore[no-untyped-def]  # noqa: PLR0917
    """A dataclass field's ``default_factory`` shows as ``<factory>``, which no parser reads."""
    if signature and "<factory>" in signature:
        return signature.replace("<factory>", "..."), return_annotation
    return None


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _resolve_gradpipe)
    app.connect("autodoc-process-signature", _factory_defaults)
