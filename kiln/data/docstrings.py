"""The embedded fine-tuning task: write a standard library function's docstring summary from its
source.

Pairs come from `ast`: every function or method with a docstring on lines of its own and a
body besides it gives (its source with the docstring lines removed, the docstring as
`ast.get_docstring` cleans it). Modules are split as the pretraining corpus splits them
(kiln/data/corpus.py), so a held-out module is never trained on here nor in the quickstart.
"""

from __future__ import annotations

import ast
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.data.corpus import stdlib_modules


@dataclass
class Pair:
    module: str
    name: str
    source: str
    """The function's source (decorators included, dedented) without its docstring."""
    docstring: str

    @property
    def summary(self) -> str:
        """The docstring's summary (PEP 257: its first paragraph), on one line: the reply the task
        trains on. The rest (arguments, examples, caveats) is beyond a model of the quickstart's size."""
        return " ".join(self.docstring.split("\n\n")[0].split())

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.source},
                {"role": "assistant", "content": self.summary}]


def function_pairs(module: str, text: str) -> list[Pair]:
    try:
        with warnings.catch_warnings():  # invalid escape sequences in old modules
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except SyntaxError:  # a file for another Python version: no pairs from it
        return []
    lines = text.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        first = node.body[0]
        before = lines[first.lineno - 1][:first.col_offset]
        after = lines[first.end_lineno - 1][first.end_col_offset:]
        if before.strip() or after.strip() not in ("", ";"):
            continue  # the docstring shares a line with other code
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        rest = lines[first.end_lineno:node.end_lineno]
        while rest and not rest[0].strip():  # the blank line that often follows a docstring
            rest = rest[1:]
        kept = lines[start - 1:first.lineno - 1] + rest
        pairs.append(Pair(module, node.name, textwrap.dedent("".join(kept)).rstrip() + "\n",
                          doc.strip()))
    return pairs


def docstring_pairs(val_fraction: float, max_bytes: int | None = None
                    ) -> tuple[Iterator[Pair], Iterator[Pair], str]:
    """(training pairs, held-out pairs, fingerprint of the stdlib text they come from); the
    pairs are parsed lazily, only when consumed (not at all when their shards are cached)."""
    modules, fingerprint = stdlib_modules(val_fraction, max_bytes)
    train = (p for m in modules if not m.held_out for p in function_pairs(m.name, m.text))
    held_out = (p for m in modules if m.held_out for p in function_pairs(m.name, m.text))
    return train, held_out, fingerprint
