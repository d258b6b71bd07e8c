"""The docs a newcomer reads stay true: docs/engine-options.md is what its generator makes from today's code,
and every path README.md and docs/ name exists."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cbjax.config import EngineConfig
from cbjax.entrypoints.cli import engine_options

REPO = Path(__file__).resolve().parents[1]


def test_engine_options_doc_is_up_to_date():
    written = (REPO / "docs" / "engine-options.md").read_text()
    assert written == engine_options.render(), (
        f"docs/engine-options.md is out of date with cbjax/config.py or cbjax/entrypoints/cli/args.py; "
        f"run `{engine_options.COMMAND}` and commit the result"
    )


def test_every_engine_option_has_a_row_with_its_default():
    rows = {line.split(" | ")[0].strip("| `"): line for line in engine_options.render().splitlines() if line.startswith("| `")}
    assert list(rows) == [field.name for field in dataclasses.fields(EngineConfig)]
    assert "| `64` |" in rows["max_num_seqs"] and "`--max-num-seqs`" in rows["max_num_seqs"]
    # cbjax serve turns prompt-bucket midpoints on where LLM leaves them off (cbjax/entrypoints/cli/args.py).
    assert "| `False` | `True` |" in rows["prompt_bucket_midpoints"]


def test_field_comments_are_the_lines_beside_and_above_each_field():
    comments = engine_options.field_comments()
    assert comments["tokenizer"] == "defaults to the model directory"
    assert comments["max_num_prefills"].startswith("Most requests that compute a prompt chunk (2+ tokens) in one step;")
    assert comments["max_num_seqs"] == ""


def test_generator_imports_no_jax():
    code = ("import json, sys; import cbjax.entrypoints.cli.engine_options as m; m.render(); "
            "print(json.dumps(sorted(name for name in ('jax', 'flax') if name in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def named_paths(doc: Path) -> set[Path]:
    """The repository paths a doc names: `cbjax/...`-style paths in its text, and its relative links."""
    text = doc.read_text()
    roots = "cbjax|kernels_pallas|kernels_cpu|tests|scripts|benchmarks|docs"
    paths = {REPO / match.split("::")[0] for match in re.findall(rf"(?<![\w./~-])(?:{roots})/[\w./-]*", text)}
    for link in re.findall(r"\]\(([^)#\s]+)\)", text):
        if "://" not in link:
            paths.add((doc.parent / link).resolve())
    return paths


def test_named_paths_finds_code_paths_and_relative_links(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See `cbjax/core/sched/policy.py`, tests/engine/test_engine.py::test_x, ~/.cache/cbjax/xla/ and "
                   "[options](engine-options.md), [vLLM](https://docs.vllm.ai/x.md).")
    assert named_paths(doc) == {
        REPO / "cbjax/core/sched/policy.py", REPO / "tests/engine/test_engine.py", tmp_path / "engine-options.md"
    }


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))])
def test_every_path_a_doc_names_exists(doc):
    path = REPO / doc if doc == "README.md" else REPO / "docs" / doc
    missing = sorted(str(p.relative_to(REPO)) for p in named_paths(path) if not p.exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}; fix the doc or restore the file"
