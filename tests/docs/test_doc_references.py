"""The docs cite only what a reader can find, and every example has a rule: a file or test
named in README.md or docs/*.md is in the repository, no issue number appears (readers
cannot look ours up), every code block says its language, and every shell or Python example
is run by a test or skipped by a named rule (tests/docs/doc_examples.py)."""

from __future__ import annotations

import re

from tests.docs.doc_examples import ROOT, RULES, blocks, classify, docs, examples, rule

TOP = ("server", "engine", "policy", "tests", "bench", "docs", "docker")
REPO_PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(TOP)})/[\w./-]*\w)(::\w+)?")
BENCH_MODULE = re.compile(r"(?<![\w./])bench(?:\.[a-z0-9_]+)+")
LINK = re.compile(r"\]\(([^)#\s]+)")
ISSUE = re.compile(r"\bissues? \d+|(?<![\w&])#\d+\b", re.IGNORECASE)
LANGUAGES = {"bash", "python", "json", "jsonl", "text", "yaml", "toml"}
MADE_BY_THE_READER = {
    "docker/.env": "the settings file docs/deployment.md tells the reader to write",
    "docs/img": "where bench.gpu.report writes its plots after a GPU session",
}
"""Paths the docs name that are not in the repository, and why that is right."""


def test_every_cited_file_and_test_exists() -> None:
    missing = []
    for path in docs():
        text = path.read_text()
        for match in REPO_PATH.finditer(text):
            cited, test = match.group(1), match.group(2)
            if any(c in cited for c in "*<{") or cited.startswith(tuple(MADE_BY_THE_READER)):
                continue
            target = ROOT / cited
            if not target.exists() and not (ROOT / f"{cited}.py").exists():
                missing.append(f"{path.name}: {cited}")
            elif test and f"def {test[2:]}(" not in target.read_text():
                missing.append(f"{path.name}: {cited}{test}")
        for link in LINK.findall(text):
            if not link.startswith("http") and not (path.parent / link).exists():
                missing.append(f"{path.name}: link {link}")
    assert not missing, missing


def names_a_module(dotted: str) -> bool:
    """Whether `bench.a.b...` is a module or package of this repository (parts after a module
    are its attributes: `bench.gpu.cases.VARIANTS`)."""
    path = ROOT
    for part in dotted.split("."):
        if (path / part / "__init__.py").is_file():
            path = path / part
        else:
            return (path / f"{part}.py").is_file()
    return True


def test_every_bench_module_named_exists() -> None:
    """`python -m bench.X` commands and `bench.X` names in the docs follow bench/'s folders."""
    missing = [
        f"{path.name}: {name}"
        for path in docs()
        for name in BENCH_MODULE.findall(path.read_text())
        if not name.endswith((".py", ".sh"))
        and not names_a_module(name)  # a file: engine's bench.py
    ]
    assert not missing, missing


def test_no_issue_numbers() -> None:
    found = [
        f"{path.name}: {m.group(0)}" for path in docs() for m in ISSUE.finditer(path.read_text())
    ]
    assert not found, found


def test_every_code_block_names_its_language() -> None:
    unnamed = [
        f"{path.name}:{line} {lang!r}"
        for path in docs()
        for line, lang, _ in blocks(path)
        if lang not in LANGUAGES
    ]
    assert not unnamed, unnamed


def test_every_example_has_a_rule() -> None:
    found = examples()
    assert len(found) > 50  # the extraction sees them all
    unruled = [f"{e.block} {e.code[:60]!r}" for e in found if classify(e) is None]
    assert not unruled, unruled
    live_in_readme = [e for e in found if e.doc == "README.md" and classify(e) is rule("daemon")]
    assert len(live_in_readme) == 2  # test_readme_first_examples_answer runs exactly two
    assert {r.kind for r in RULES} == {"live", "skip", "slow", "setup", "fast"}
