"""Sphinx configuration of jdp's documentation: MyST Markdown pages, an API reference from the
docstrings, and a config and CLI reference generated from jdp's own objects at build time.

Build it strictly, as CI does:

    sphinx-build -W --keep-going -n -b html docs docs/_build/html
"""
import os
import sys

# Fake CPU devices are never needed to import jdp's modules, but keep a GPU host's jax off them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import jdp  # noqa: E402

project = "jdp"
author = "the jdp authors"
copyright = "the jdp authors"
release = version = jdp.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "jdp_reference",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

# MyST: ```python fences are code (the docs test runs each one); {eval-rst} holds autodoc's directives.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# API reference. Docstrings are plain text with `code` in single backticks: render those as code.
default_role = "code"
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autosummary_generate = False
add_module_names = False

# Strict builds (-n) check every cross-reference. jax, numpy, optax, flax, orbax and grain are
# documented elsewhere and intersphinx would need the network at build time: their names stay
# plain text instead of links.
nitpick_ignore_regex = [
    ("py:.*", r"(jax|jnp|jaxlib|np|numpy|optax|flax|nnx|nn|orbax|ocp|grain|yaml|argparse|collections|typing|os|"
              r"concurrent|pytest|_pytest|dataclasses|enum|types|pathlib)(\..*)?"),
    ("py:.*", r"(Array|ArrayLike|PyTree|Any|Callable|Iterable|Iterator|Mapping|Sequence|NamedTuple|ClassVar|"
              r"Path|PathLike|Mesh|Sharding|NamedSharding|PartitionSpec|GradientTransformation|"
              r"GradientTransformationExtraArgs|Module|Rngs|Optimizer|Param|State|GraphDef|TrainState|"
              r"ndarray|dtype|DTypeLike|Device)"),
]

html_theme = "furo"
html_title = f"jdp {release}"
html_static_path = []
html_show_sourcelink = True
# The built site opens offline from the file system: furo ships its CSS, JS and fonts' stack; no
# page uses math, so MathJax (a CDN script) is never loaded.
