"""The contract of each HeteroRL option is stated once, in its field's docstring; the trailing
``# comment`` of its key in ``gepo_trainer.yaml`` is that docstring's first line, the summary
(``python -m scripts.dev.sync_yaml_comments`` writes them). Every field is in the YAML and every
key the YAML writes under ``hetero:`` / ``task:`` / ``verl_engine:`` is a field."""

from __future__ import annotations

import pytest

from scripts.dev import sync_yaml_comments as sync

MAX_DOC_LINES = 4
"""A field's docstring is a contract: the summary and a few lines; evidence goes to docs/."""


@pytest.fixture(scope="module")
def opts():
    return sync.options()


@pytest.fixture(scope="module")
def yaml_text():
    return sync.YAML_PATH.read_text()


def test_every_option_is_found(opts):
    keys = {opt.key for opt in opts}
    # leaves, nested sections and their fields, of every section
    for key in ("hetero.engine", "hetero.delay", "hetero.delay.dist", "hetero.trust", "hetero.trust.max_divergence"):
        assert key in keys
    assert {"task.name", "task.template", "verl_engine.old_log_prob", "verl_engine.preset"} <= keys
    assert {opt.key.split(".")[0] for opt in opts} == {"hetero", "task", "verl_engine"}


def test_every_docstring_opens_with_a_one_line_summary(opts):
    problems = sync.docstring_problems(opts)
    assert not problems, "\n".join(problems)


def test_field_docstrings_are_short_contracts(opts):
    lines = {opt.key: len(opt.doc.splitlines()) for opt in opts if opt.doc}
    long = {key: n for key, n in lines.items() if n > MAX_DOC_LINES}
    assert not long, f"docstrings over {MAX_DOC_LINES} lines (move evidence and detail to docs/): {long}"


def test_every_field_is_in_the_yaml_and_every_yaml_key_is_a_field(opts, yaml_text):
    leaves = {opt.key for opt in opts if not opt.section}
    entries = sync.yaml_entries(yaml_text, ("hetero", "task", "verl_engine"))
    written = {key for key in entries if key.rpartition(".")[0] not in leaves}  # not a dict value's keys
    for section in sync.REQUIRED_SECTIONS:
        fields = {opt.key for opt in opts if opt.key.split(".")[0] == section}
        mine = {key for key in written if key.split(".")[0] == section}
        assert not fields - mine, f"fields missing from gepo_trainer.yaml: {sorted(fields - mine)}"
        assert not mine - fields, f"keys in gepo_trainer.yaml that are no field: {sorted(mine - fields)}"


def test_yaml_comments_are_the_docstring_summaries(opts, yaml_text):
    problems = sync.yaml_problems(yaml_text, opts)
    assert not problems, (
        "gepo_trainer.yaml and the option docstrings differ (python -m scripts.dev.sync_yaml_comments "
        "rewrites the comments):\n" + "\n".join(problems)
    )


def _replace_line(text: str, start: str, new: str) -> str:
    lines = text.splitlines(keepends=True)
    (index,) = [i for i, line in enumerate(lines) if line.lstrip().startswith(start)]
    lines[index] = new
    return "".join(lines)


def test_the_check_can_fail(opts, yaml_text):
    drifted = _replace_line(
        yaml_text, "max_divergence:", "    max_divergence: 0.0    # bound on mean(log q - log p); 0 = off\n"
    )
    problems = sync.yaml_problems(drifted, opts)
    (problem,) = [p for p in problems if p.startswith("hetero.trust.max_divergence:")]
    assert "mean(log q - log p)" in problem
    summary = next(o for o in opts if o.key == "hetero.trust.max_divergence").summary
    assert repr(summary) in problem
    missing = _replace_line(yaml_text, "divergence_window:", "")
    assert any(p.startswith("hetero.trust.divergence_window: field") for p in sync.yaml_problems(missing, opts))
    extra = _replace_line(yaml_text, "seed:", "  seed: 0\n  sede: 1  # a typo\n")
    assert any(p.startswith("hetero.sede: key in the YAML") for p in sync.yaml_problems(extra, opts))
    # a key under a dict-valued field is its value, not a field
    valued = _replace_line(yaml_text, "dataset_options:", "  dataset_options:  # x\n    split: train\n")
    assert not any("dataset_options.split" in p for p in sync.yaml_problems(valued, opts))
    half = opts[0]._replace(doc="A sentence cut\nin two.", line="    " + '"""A sentence cut')
    wide = opts[0]._replace(doc="Wide.", line=" " * 120 + '"""Wide."""')
    (cut,) = sync.docstring_problems([half])
    assert "not a complete phrase" in cut
    (too_wide,) = sync.docstring_problems([wide])
    assert "columns" in too_wide
    (markup,) = sync.docstring_problems([opts[0]._replace(doc="Uses ``x``.", line='    """Uses ``x``.')])
    assert "markup" in markup


def test_the_generator_rewrites_only_the_trailing_comments(opts, yaml_text, tmp_path):
    drifted = _replace_line(
        yaml_text, "max_divergence:", "    max_divergence: 0.0    # bound on mean(log q - log p); 0 = off\n"
    )
    drifted = _replace_line(drifted, "digits:", "  digits: 3\n")  # no comment at all
    fixed = sync.rewrite(drifted, opts)
    assert sync.yaml_problems(fixed, opts) == []
    assert sync.rewrite(fixed, opts) == fixed
    for before, after in zip(drifted.splitlines(), fixed.splitlines(), strict=True):
        if before != after:  # the same key and value, another comment
            assert after.startswith(before.split(" #")[0].rstrip() + " ")
    path = tmp_path / "gepo_trainer.yaml"
    path.write_text(drifted)
    assert sync.main(["--check", "--yaml", str(path)]) == 1
    assert path.read_text() == drifted
    assert sync.main(["--yaml", str(path)]) == 0
    assert sync.main(["--check", "--yaml", str(path)]) == 0
