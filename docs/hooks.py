"""mkdocs hook: the docstrings name code with Sphinx roles (``:class:`Pipeline```), which the
Markdown docstring renderer shows literally; the role's prefix is dropped so the name reads as code."""

import re

_ROLE = re.compile(r":(?:py:)?(?:meth|class|func|mod|data|attr|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", html)
