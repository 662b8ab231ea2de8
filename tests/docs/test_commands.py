"""Every command README.md and docs/*.md show still holds: each ``python examples/...`` line parses with the
example's own arguments (``train_lm.py`` and ``clip_compare.py`` lines compose with Hydra into a valid
config, every swept value included), each ``gradloc-track ...`` line parses with the CLI, and each
``pip install`` names extras pyproject.toml defines. The one install line runs every example the README
lists: the ``[examples]`` extra brings every third-party module an example imports."""
from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from ..examples.load import load_example
from .snippets import DOCS, ROOT

FENCE = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
INLINE = re.compile(r"`((?:python3? |torchrun [^`]*?)examples/[^`]+|gradloc-track (?:report|culprits|replay) [^`]+)`")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def commands() -> list[tuple[str, str]]:
    """(where, command) of every command line the docs show: fenced bash blocks (continuations joined,
    ``&&`` chains split, comments cut) and inline ``python examples/...`` / ``gradloc-track ...`` spans."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    out.append((path.name, part.split("  #")[0].split(" # ")[0].strip()))
        out += [(path.name, m) for m in INLINE.findall(text)]
    return [(w, c) for w, c in out if c]


def argv(command: str) -> list[str]:
    """The command's words with the docs' placeholders filled in (``<run dir>`` -> ``X``, ``...`` dropped)."""
    command = re.sub(r"<[^>]*>", "X", command).replace("...", " ")
    return [w for w in shlex.split(command) if w not in ("[", "]")]


def compose(overrides: list[str], base: tuple[str, ...] = ()) -> None:
    """Hydra composition of the demo's config as the app does it, once per swept value."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from gradloc_track.config import check_overrides, to_config
    from gradloc_track.demo.config import DemoConfig, register_configs

    check_overrides(overrides, DemoConfig, ROOT / "conf")
    register_configs()
    sweeps = [[f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] if "," in o else [o]
              for o in overrides]
    jobs = [[s[min(i, len(s) - 1)] for s in sweeps] for i in range(max([len(s) for s in sweeps] or [1]))]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for job in jobs:
            to_config(hydra_compose("config", overrides=[*base, *job]))


def check_example(words: list[str]) -> None:
    script = next(w for w in words if w.startswith("examples/"))
    name, args = Path(script).stem, words[words.index(script) + 1:]
    if name == "train_lm":
        compose([a for a in args if not a.startswith("-")])
    elif name == "clip_compare":
        compose(args, base=("experiment=clip_compare",))
    else:
        load_example(name).parse_args(args)  # SystemExit (argparse's error) fails the test


def check_cli(words: list[str]) -> None:
    from gradloc_track.cli import _parser

    _parser().parse_args(words[1:])


def check_pip(words: list[str]) -> None:
    for spec in words:
        m = re.fullmatch(r"(?:\.|gradloc-track)\[([\w,-]+)\]", spec)
        if m:
            missing = set(m.group(1).split(",")) - set(EXTRAS)
            assert not missing, f"pyproject.toml has no extra {missing}"


DOCUMENTED = commands()


@pytest.mark.parametrize("where,command", DOCUMENTED, ids=[f"{w}:{c[:60]}" for w, c in DOCUMENTED])
def test_every_documented_command_parses(where, command):
    words = argv(command)
    if any(w.startswith("examples/") and w.endswith(".py") for w in words):
        check_example(words)
    elif words[0] == "gradloc-track":
        check_cli(words)
    elif words[:2] == ["pip", "install"]:
        check_pip(words)


def test_the_docs_show_the_commands_this_test_checks():
    shown = " ".join(c for _, c in DOCUMENTED)
    for needle in ("examples/train_lm.py experiment=spike_demo", "gradloc-track report", "gradloc-track culprits",
                   "pip install -e '.[examples]'", "examples/trl_grpo.py", "examples/hf_trainer.py"):
        assert needle in shown, needle


def test_a_broken_command_fails_the_check():
    with pytest.raises(Exception, match="monitor.log_evry"):
        check_example(argv("python examples/train_lm.py monitor.log_evry=5"))
    with pytest.raises(SystemExit):
        check_example(argv("python examples/hf_trainer.py --inject-step 60"))
    with pytest.raises(AssertionError, match="no extra"):
        check_pip(argv("pip install -e '.[exmaples]'"))


def extra_requirements(name: str, seen: set[str] | None = None) -> set[str]:
    """The distributions an extra brings, its self-references (``gradloc-track[hf]``) followed."""
    seen = set() if seen is None else seen
    out = set()
    for req in EXTRAS[name]:
        dist = re.split(r"[<>=!\[; ]", req, maxsplit=1)[0].lower()
        if dist == "gradloc-track":
            for sub in re.search(r"\[([\w,-]+)\]", req).group(1).split(","):
                if sub not in seen:
                    seen.add(sub)
                    out |= extra_requirements(sub, seen)
        else:
            out.add(dist)
    return out


def imported_modules(path: Path) -> set[str]:
    """Top-level modules a script imports (anywhere in it, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


# examples that run in an install of their own (docs/verl.md: verl pins transformers below our other extras):
# every examples/verl_*.py, listed on docs/verl.md
OWN_EXTRA = {"verl_": "verl"}


def own_extra(stem: str) -> str | None:
    return next((extra for prefix, extra in OWN_EXTRA.items() if stem.startswith(prefix)), None)


def test_the_examples_extra_installs_every_module_an_example_imports():
    core = {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0].lower() for r in PYPROJECT["project"]["dependencies"]}
    local = {p.stem for p in (ROOT / "examples").glob("*.py")} | {"gradloc_track", "tests"}
    dists = packages_distributions()
    for script in sorted((ROOT / "examples").glob("*.py")):
        extra = own_extra(script.stem) or "examples"
        have = extra_requirements(extra) | core
        for mod in sorted(imported_modules(script) - local - set(sys.stdlib_module_names)):
            names = {d.lower() for d in dists.get(mod, [mod])}
            assert names & have, f"examples/{script.name} imports {mod} ({names}), which [{extra}] does not install"


def test_the_readme_installs_the_examples_extra_once_and_lists_every_example():
    """Every example is named in the README; one in an install of its own on its page (verl's: docs/verl.md)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install -e '.[examples]'" in readme and "pip install -e '.[demo]'" in readme
    for script in sorted((ROOT / "examples").glob("*.py")):
        page = readme if own_extra(script.stem) is None else (ROOT / "docs" / "verl.md").read_text(encoding="utf-8")
        assert f"examples/{script.name}" in page or script.stem in page, script.name
