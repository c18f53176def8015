"""The docs cannot go stale unseen: every command README.md and docs/ show is one the project accepts, and every
relative link (and its #anchor) resolves.

A `dflash-*` command (or `python -m dflash_pipeline.*`, or either under `accelerate launch`) composes its Hydra config
with its overrides and passes the schema's checks, without running; a `python scripts/*.py` or `dflash-compare` line
passes its argument parser (and composes the Hydra overrides it carries). Commands are read from code blocks (shell
variables set earlier in the document are expanded, `\\` continuations joined) and from inline code spans.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from dflash_pipeline.conf.schema import check_config, register

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"^(dflash-(pipeline|teacher|train|eval|producer|compare)|python3? (scripts/\S+\.py|-m dflash_pipeline\.)"
                     r"|accelerate launch)(\s|$)")
HYDRA_MODULES = {"dflash_pipeline.data", "dflash_pipeline.train"}  # the modules `accelerate launch -m` runs


def code_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced or 4-space indented code block (indented ones only outside lists' prose)."""
    blocks, current, fenced = [], None, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                blocks.append(current)
                current, fenced = None, False
            else:
                current, fenced = [], True
            continue
        if fenced:
            current.append(line)
        elif line.startswith("    ") and (current is not None or not line.strip().startswith(("-", "*", "|"))):
            current = [] if current is None else current
            current.append(line[4:])
        elif current is not None and line.strip():
            blocks.append(current)
            current = None
    if current:
        blocks.append(current)
    return blocks


def _expand(statement: str, env: dict[str, str]) -> str:
    statement = re.sub(r"\$\(realpath ([^)]+)\)", r"\1", statement)
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: env.get(m.group(1), m.group(0)), statement)


def _statements(lines: list[str]) -> list[str]:
    """Shell statements: continuations joined, comments dropped, split on ; && || and pipes."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        out += [s.strip() for s in re.split(r";|&&|\|\|?", line) if s.strip()]
    return out


def commands(text: str) -> list[str]:
    """Every project command the document shows, shell variables set earlier in it expanded."""
    found, env = [], {}
    for block in code_blocks(text):
        for s in _statements(block):
            s = _expand(s, env)
            assignment = re.fullmatch(r"(?:export )?([A-Za-z_]\w*)=(.*)", s)
            if assignment and " " not in assignment.group(2).strip("\"'") or (
                    assignment and assignment.group(2)[:1] in "\"'"):
                env[assignment.group(1)] = assignment.group(2).strip("\"'")
                continue
            s = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+", "", s)  # leading environment settings
            if COMMAND.match(s):
                found.append(s)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        span = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+", "", span.strip())
        launch_only = span.startswith("accelerate launch") and not re.search(r"-m \S|\.py\b", span)
        if COMMAND.match(span) and " " in span and not launch_only:
            found.append(span)
    return list(dict.fromkeys(found))


class Rejected(Exception):
    """A command the project does not accept, with the project's own message."""


def _placeholder(arg: str) -> str | None:
    """`<run folder>` becomes a literal; an override whose value is elided (`experiment=...`) is left out."""
    if re.fullmatch(r"[\w.+~/]+=(\.\.\.|<[^>]*>)", arg):
        return None
    return re.sub(r"<([^>]*)>", lambda m: re.sub(r"\W+", "_", m.group(1)), arg)


def compose_overrides(overrides: list[str]) -> None:
    """Compose conf/config.yaml as the console scripts do (a sweep's first job for `-m` ones) and check the schema."""
    GlobalHydra.instance().clear()
    register()
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                 else o.input_line for o in parsed]
        with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
            cfg = compose("config", overrides=first, return_hydra_config=True)
        check_config(cfg)
    except Exception as e:  # noqa: BLE001 - every composition error is the finding
        raise Rejected(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        GlobalHydra.instance().clear()


class _Parsed(Exception):
    pass


def parse_script(run, argv: list[str]) -> argparse.Namespace:
    """Run a script's main up to its argument parser, and stop there with what it parsed."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            mock.patch.object(sys, "argv", ["script", *argv]), contextlib.redirect_stderr(err):
        try:
            run()
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit:
            raise Rejected(err.getvalue().strip().splitlines()[-1]) from None
    raise Rejected("the script never parsed a command line")


def check_command(command: str) -> None:
    """Raise Rejected unless the project accepts `command` (without running it)."""
    command = re.sub(r"<([^>]*)>", lambda m: "<" + re.sub(r"\W+", "_", m.group(1)) + ">", command)  # one word each
    args = [a for a in (_placeholder(a) for a in shlex.split(command)) if a is not None]
    if args[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                launch = launch_command_parser().parse_args(args[2:])
        except SystemExit:
            raise Rejected(err.getvalue().strip().splitlines()[-1]) from None
        if launch.config_file and not (ROOT / launch.config_file).is_file():
            raise Rejected(f"no accelerate config {launch.config_file}")
        script = launch.training_script
        args = (["python", "-m", script] if launch.module else ["python", script]) + launch.training_script_args
    if args[0].startswith("python"):
        if args[1] == "-m":
            if args[2] not in HYDRA_MODULES:
                raise Rejected(f"no module {args[2]} with a command line")
            args = ["dflash-teacher" if args[2].endswith("data") else "dflash-train", *args[3:]]
        else:
            path = ROOT / args[1]
            if not path.is_file():
                raise Rejected(f"no script {args[1]}")
            parsed = parse_script(lambda: runpy.run_path(str(path), run_name="__main__"), args[2:])
            if getattr(parsed, "overrides", None):
                compose_overrides(parsed.overrides)
            return
    if args[0] == "dflash-compare":
        from dflash_pipeline.eval.compare import main

        parse_script(main, args[1:])
        return
    compose_overrides([a for a in args[1:] if a not in ("-m", "--multirun")])


_SLUG_DROP = re.compile(r"[^\w\- ]")


def anchors(md: Path) -> Iterator[str]:
    """GitHub's heading anchors of a Markdown file (lowercase, punctuation dropped, spaces to hyphens, -N on
    repeats)."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _SLUG_DROP.sub("", heading.strip().lower().replace("`", "")).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def broken_links(md: Path, text: str) -> list[str]:
    """Relative links of `text` (a file at `md`) whose file or anchor does not exist."""
    problems = []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            problems.append(f"link {target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest)):
            problems.append(f"link {target}: no heading #{anchor} in {dest.name}")
    return problems


def problems_in(md: Path, text: str) -> list[str]:
    problems = broken_links(md, text)
    for command in commands(text):
        try:
            check_command(command)
        except Rejected as e:
            problems.append(f"`{command}`: {e}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_command_and_link_in_the_docs_is_accepted(doc):
    problems = problems_in(doc, doc.read_text())
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_readme_shows_commands_of_every_kind():
    """The check reads what the README shows: the two commands, stages, a GPU launch and scripts."""
    found = commands((ROOT / "README.md").read_text())
    for start in ("dflash-pipeline experiment=smollm2_quick", "accelerate launch", "python scripts/", "dflash-eval"):
        assert any(c.startswith(start) for c in found), start


def test_a_command_or_link_the_project_does_not_have_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    text = "\n".join([
        "    dflash-train experiment=tiny trainer.no_such_option=1",
        "    python scripts/bench_teacher.py --no-such-flag",
        "",
        "Run `dflash-eval experiment=no_such_experiment` or `accelerate launch --no-such -m dflash_pipeline.train`.",
        "See [the guide](nowhere.md) and [metrics](" + os.path.relpath(ROOT / "docs/metrics.md", tmp_path)
        + "#no-such-heading).",
        "",
        "    Q=runs/x; C=\"experiment=tiny trainer.steps=2\"",
        "    dflash-train $C trainer.lr=1e-3",
    ])
    problems = problems_in(doc, text)
    assert len(problems) == 6, problems
    expected = ["no_such_option", "--no-such-flag", "no_such_experiment", "--no-such", "nowhere.md",
                "no-such-heading"]
    for word in expected:
        assert any(word in p for p in problems), (word, problems)
    assert not any("trainer.lr" in p for p in problems), "the block's variables expand to an accepted command"
