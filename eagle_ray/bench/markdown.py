"""Markdown for docs/benchmarks.md that a person reads in an editor as well as rendered: prose
wrapped to short lines, and tables whose lines never pass `MAX_LINE` characters -- a table too
wide is split into several that repeat its setting columns, and a table of one setting is
turned on its side (a line per figure) rather than printed as one very long line."""

from __future__ import annotations

import textwrap

MAX_LINE = 250  # no line of the page is longer
WRAP = 100  # prose is wrapped here (Markdown joins the lines back into one paragraph)


def wrap(text: str) -> str:
    """`text` as lines of at most `WRAP` characters (code spans and numbers kept whole)."""
    return textwrap.fill(text, WRAP, break_long_words=False, break_on_hyphens=False)


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _rule(count: int) -> str:
    return "|" + "---|" * count


def table(keys: list[str], columns: list[str], lines: list[list[str]]) -> list[str]:
    """A table of `lines` (each: a cell per key, then one per column; "" for none). Without keys
    there is one line, printed as `figure | value` lines; otherwise columns are packed into as
    few tables as keep every line within `MAX_LINE`, each table leaving out the lines that have
    no figure in its columns."""
    if not keys:
        [only] = lines
        return [_line(["figure", "value"]), _rule(2)] + [
            _line([column, value]) for column, value in zip(columns, only, strict=True) if value]
    out: list[str] = []
    for group in _column_groups(keys, columns, lines):
        if out:
            out.append("")
        out += [_line(keys + [columns[i] for i in group]), _rule(len(keys) + len(group))]
        for line in lines:
            figures = [line[len(keys) + i] for i in group]
            if any(figures):
                out.append(_line(line[:len(keys)] + figures))
    return out


def _column_groups(keys: list[str], columns: list[str], lines: list[list[str]]) -> list[list[int]]:
    """Consecutive column indices packed greedily so that no line of a table is too long."""

    def widest(group: list[int]) -> int:
        rows = [keys + [columns[i] for i in group]]
        rows += [line[:len(keys)] + [line[len(keys) + i] for i in group] for line in lines]
        return max(len(_line(row)) for row in rows)

    groups: list[list[int]] = [[]]
    for i in range(len(columns)):
        if groups[-1] and widest(groups[-1] + [i]) > MAX_LINE:
            groups.append([])
        groups[-1].append(i)
    return groups
