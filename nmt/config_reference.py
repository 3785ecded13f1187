"""The reference of every config key, generated from the config dataclasses: `docs/config.md`.

    python -m nmt.config_reference > docs/config.md

Each key is listed by its dotted path (`train.lr`, `data.train.src`), with its type, its default as YAML shows
it, the values it accepts where there is a fixed set, and its meaning. The meaning is the field's own source
comment: the comment lines directly above the field and the trailing comment on its line, read with
`tokenize` (so a `#` inside a string default is never taken for a comment). The accepted values come from the
`validate()` checks of the form `self.key not in (...)`, and from the registries for names that live there
(`exchange.method`, the presets).

Why generated: a hand-written list goes stale the day a field is added. The test
tests/unit/nmt/test_config_reference.py fails when docs/config.md differs from this output, so adding or
changing a field means regenerating the file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from nmt.config import Config
from nmt.models.config import PRESETS as MODEL_PRESETS

COMMAND = "python -m nmt.config_reference > docs/config.md"


@dataclass(frozen=True)
class KeyDoc:
    """One row of the reference: a leaf field of the config, by its dotted path."""

    key: str  # dotted path, e.g. train.lr
    type: str  # the annotation as written, e.g. list[float]
    default: str  # as YAML shows it, e.g. 0.0005, '' or [0.9, 0.98]
    choices: tuple[str, ...]  # accepted values (as YAML shows them); empty when any value of the type goes
    meaning: str  # from the field's source comments; empty when it has none


@dataclass(frozen=True)
class Section:
    """One table of the reference: a section of the recipe (`train:`), or the top-level keys."""

    title: str
    cls: type  # the dataclass that holds the keys
    keys: list[KeyDoc]


# ------------------------------------------------------------------------------------- source comments


def _class_source(cls: type) -> str:
    return textwrap.dedent(inspect.getsource(cls))


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its meaning: the comment lines directly above it, then its trailing comment.

    A blank line between a comment block and a field detaches the block. Fields inherited from a dataclass
    base take their comments from the base's source.
    """
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not object:
            comments.update(_own_field_comments(klass))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    comments: dict[str, str] = {}
    depth = 0  # 1 = the class body
    above: list[str] = []  # comment lines directly above the current logical line
    line: list[tokenize.TokenInfo] = []  # tokens of the current logical line, its comments included
    for tok in tokenize.generate_tokens(io.StringIO(_class_source(cls)).readline):
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.COMMENT and not line:
            above.append(_comment_text(tok))
        elif tok.type == tokenize.NL:
            if not line and not tok.line.strip():  # a blank line detaches the comments above it
                above = []
        elif tok.type == tokenize.NEWLINE:
            code = [t for t in line if t.type != tokenize.COMMENT]
            is_field = len(code) >= 2 and code[0].type == tokenize.NAME and code[1].string == ":"
            if depth == 1 and is_field:
                trailing = [_comment_text(t) for t in line if t.type == tokenize.COMMENT]
                comments[code[0].string] = _join_comments(above, trailing)
            above, line = [], []
        else:
            line.append(tok)
    return comments


def _comment_text(tok: tokenize.TokenInfo) -> str:
    return tok.string.lstrip("#").strip()


def _join_comments(above: list[str], trailing: list[str]) -> str:
    block = " ".join(text for text in above if text)
    after = " ".join(text for text in trailing if text)
    if block and after:
        return f"{block}{'' if block[-1] in '.:;' else '.'} {after}"
    return block or after


# ------------------------------------------------------------------------------------------ choices


def validated_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """Dotted path relative to `cls` -> the values its `validate()` accepts, from `self.x not in (...)`.

    Also understood: a check on each item of a list, `[m for m in self.metrics if m not in (...)]`.
    """
    tree = ast.parse(_class_source(cls))
    methods = [
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "validate"
    ]
    choices: dict[str, tuple[Any, ...]] = {}
    for method in methods:
        items = {
            comp.target.id: path
            for comp in ast.walk(method)
            if isinstance(comp, ast.comprehension) and isinstance(comp.target, ast.Name)
            for path in [_self_path(comp.iter)]
            if path
        }
        for node in ast.walk(method):
            if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
                continue
            if not isinstance(node.ops[0], (ast.In, ast.NotIn)):
                continue
            values = node.comparators[0]
            if not isinstance(values, (ast.Tuple, ast.List, ast.Set)):
                continue
            if not all(isinstance(v, ast.Constant) for v in values.elts):
                continue
            left = node.left
            path = items.get(left.id) if isinstance(left, ast.Name) else _self_path(left)
            if path:
                choices[path] = tuple(v.value for v in values.elts)  # type: ignore[attr-defined]
    return choices


def _self_path(node: ast.AST) -> str:
    """`self.vocab.type` -> "vocab.type"; "" for anything that is not an attribute chain on `self`."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return ""


def registry_choices() -> dict[str, tuple[Any, ...]]:
    """Keys whose accepted names live in a registry rather than in a `validate()` tuple."""
    from compression.config import SBC_PRESETS
    from compression.registry import available_methods

    return {
        "model.preset": tuple(MODEL_PRESETS),
        "exchange.method": tuple(available_methods()),
        "exchange.sbc.preset": tuple(SBC_PRESETS),
    }


# --------------------------------------------------------------------------------------------- rows


def yaml_value(value: Any) -> str:
    """`value` as YAML writes it in a flow context: 0.0005, '', true, [0.9, 0.98]."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=float("inf"))
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _type_name(f: dataclasses.Field) -> str:
    if isinstance(f.type, str):  # `from __future__ import annotations`: the annotation as written
        return f.type
    return getattr(f.type, "__name__", None) or repr(f.type)


def key_docs(cls: type = Config, prefix: str = "") -> list[KeyDoc]:
    """Every leaf field of `cls`, nested dataclasses recursed, in field order."""
    choices = {**_choices_below(cls, prefix), **registry_choices()}
    return _key_docs(cls, prefix, choices)


def _choices_below(cls: type, prefix: str) -> dict[str, tuple[Any, ...]]:
    found = {prefix + path: values for path, values in validated_choices(cls).items()}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            found.update(_choices_below(hints[f.name], f"{prefix}{f.name}."))
    return found


def _key_docs(cls: type, prefix: str, choices: dict[str, tuple[Any, ...]]) -> list[KeyDoc]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += _key_docs(hints[f.name], key + ".", choices)
            continue
        rows.append(
            KeyDoc(
                key=key,
                type=_type_name(f),
                default=yaml_value(_default(f)),
                choices=tuple(yaml_value(v) for v in choices.get(key, ())),
                meaning=comments.get(f.name, ""),
            )
        )
    return rows


def sections() -> list[Section]:
    """The top-level keys, then one section per dataclass field of `Config`, in field order."""
    rows = key_docs(Config)
    hints = typing.get_type_hints(Config)
    top = Section("Top level", Config, [])
    result = [top]
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            keys = [row for row in rows if row.key.startswith(f.name + ".")]
            result.append(Section(f.name, hints[f.name], keys))
        else:
            top.keys.extend(row for row in rows if row.key == f.name)
    return [section for section in result if section.keys]


# ------------------------------------------------------------------------------------------ markdown


def _cell(text: str) -> str:
    """Table-cell text: pipes would split the cell and `<word>` could be taken for an HTML tag."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<")


def _code(text: str) -> str:
    return f"`{text.replace('|', chr(92) + '|')}`"


def _docstring(cls: type) -> str:
    """The first paragraph of the class's own docstring ("" when it has none; not dataclass's signature)."""
    tree = ast.parse(_class_source(cls))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    doc = ast.get_docstring(node) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _table(keys: list[KeyDoc]) -> list[str]:
    lines = ["| Key | Type | Default | Choices | Meaning |", "| --- | --- | --- | --- | --- |"]
    for row in keys:
        choices = ", ".join(_code(c) for c in row.choices)
        cells = [_code(row.key), _code(row.type), _code(row.default), choices, _cell(row.meaning)]
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def _model_presets() -> list[str]:
    lines = [
        "",
        "`model.preset` fills the model keys a recipe leaves unset (keys the recipe sets win):",
        "",
        "| Preset | Sets |",
        "| --- | --- |",
    ]
    for name, values in MODEL_PRESETS.items():
        sets = ", ".join(_code(f"{key}: {yaml_value(value)}") for key, value in values.items())
        lines.append(f"| {_code(name)} | {sets} |")
    return lines


def _sbc_presets() -> list[str]:
    from compression.config import SBC_PRESETS

    lines = [
        "",
        "`exchange.sbc.preset` replaces `exchange.sbc.delay` and `exchange.sbc.density` with one of the "
        "paper's:",
        "",
        "| Preset | Sets |",
        "| --- | --- |",
    ]
    for name, (delay, density) in SBC_PRESETS.items():
        sets = f"{_code(f'delay: {delay}')}, {_code(f'density: {yaml_value(density)}')}"
        lines.append(f"| {_code(name)} | {sets} |")
    return lines


_INTRO = """\
# Configuration reference

Generated from the config dataclasses by `{command}`;
do not edit it by hand. Regenerate it whenever a config field is added or changed:
tests/unit/nmt/test_config_reference.py fails while it is out of date.

One YAML recipe drives training, validation, decoding and the gradient exchange; below are all its {count}
keys. The recipes in recipes/ are examples to start from: a recipe sets only the keys it needs, and every
other key keeps the default below. A key is written in its section of the recipe (`train:` then
`lr: 1e-3`) or given on the command line by its dotted path
(`nmt-train --config recipes/bible-es-en.yml train.lr=1e-3`). An unknown key is an error that names the
nearest valid one, and `nmt-train --config FILE --dump-config` prints the effective configuration.

Default is the value as YAML writes it; Choices lists the accepted values where there is a fixed set;
Meaning is the field's comment in the source of its dataclass."""


def render() -> str:
    """The whole of docs/config.md."""
    count = sum(len(section.keys) for section in sections())
    lines = _INTRO.format(command=COMMAND, count=count).split("\n")
    for section in sections():
        source = f"{section.cls.__module__.replace('.', '/')}.py"
        intro = f"`{section.cls.__name__}` in {source}."
        doc = _docstring(section.cls)
        if doc:
            intro += f" {doc}"
        title = section.title if section.title == "Top level" else f"`{section.title}:`"
        lines += ["", f"## {title}", "", intro, "", *_table(section.keys)]
        if section.title == "model":
            lines += _model_presets()
        if section.title == "exchange":
            lines += _sbc_presets()
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.reconfigure(encoding="utf-8")  # type: ignore[union-attr]
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
