"""Bad data gets one clear line: file:line and what was expected; on_bad_row=skip counts instead.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_data_errors.py
"""

from __future__ import annotations

import pytest

from tests.helpers import DATA_ASSETS as ASSETS
from tests.helpers import data_cfg, source, tiny_tokenizer
from workbench.core.errors import UserError
from workbench.data import pipeline, readers
from workbench.data.recipes import load_recipe


def tokenise(tmp_path, src, **kw):
    tokenizer, contract = tiny_tokenizer()
    return pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path, **kw))


def test_bad_row_names_file_line_and_the_expected_shape(tmp_path):
    with pytest.raises(UserError) as exc:
        tokenise(tmp_path, source("bad_row.jsonl", "messages"))
    msg = str(exc.value)
    assert msg.startswith(f"{ASSETS / 'bad_row.jsonl'}:2: row has no 'messages' field")
    assert '{"messages": [{"role": "user"' in msg  # what was expected


def test_skip_policy_counts_and_keeps_the_good_rows(tmp_path):
    out = tokenise(tmp_path, source("bad_row.jsonl", "messages"), on_bad_row="skip")
    assert len(out.examples) == 2 and out.skipped == 1 and out.rows_read == 3
    assert out.bad[0].startswith(f"{ASSETS / 'bad_row.jsonl'}:2:")
    assert out.report()["skipped"] == 1


def test_auto_format_that_fits_nothing_says_what_fits(tmp_path):
    with pytest.raises(UserError, match=r"bad_row.jsonl:2: cannot tell the row's format .* alpaca"):
        next(iter(_rows_formats("bad_row.jsonl")))


def _rows_formats(name):
    from workbench.data.formats import detect_format

    for where, row in readers.iter_rows(ASSETS / name):
        if "messages" not in row:
            yield detect_format(row, where)


def test_empty_source(tmp_path):
    with pytest.raises(UserError, match=r"empty.jsonl: empty source \(no rows\)"):
        tokenise(tmp_path, source("empty.jsonl"))


def test_missing_column_mapping(tmp_path):
    # no mapping: the columns fit no format, and the message says how to map them
    with pytest.raises(UserError, match=r"mapped.jsonl:1: row has no 'prompt' field .*columns: \{prompt: <yours>\}"):
        tokenise(tmp_path, source("mapped.jsonl", "prompt_completion"))
    # a mapping naming a column the file does not have
    src = source("mapped.jsonl", "prompt_completion", columns={"prompt": "query", "completion": "answer"})
    with pytest.raises(UserError, match=r"mapped.jsonl:1: column mapping prompt: 'query' names a column this row "
                                        r"does not have \(columns: \['answer', 'question'\]\)"):
        tokenise(tmp_path, src)


def test_non_utf8_file():
    with pytest.raises(UserError, match=r"not_utf8.jsonl:1: not UTF-8 text .* re-save the file as UTF-8"):
        list(readers.iter_rows(ASSETS / "not_utf8.jsonl"))


def test_truncated_last_line():
    with pytest.raises(UserError, match=r"truncated.jsonl:2: the last line is truncated"):
        list(readers.iter_rows(ASSETS / "truncated.jsonl"))


def test_malformed_middle_line_is_not_called_truncated(tmp_path):
    p = tmp_path / "mid.jsonl"
    p.write_text('{"text": "a"}\n{"text": \n{"text": "c"}\n')
    with pytest.raises(UserError, match=r"mid.jsonl:2: malformed JSON"):
        list(readers.iter_rows(p))


def test_csv_and_json_shape_errors(tmp_path):
    (tmp_path / "short.csv").write_text("instruction,output\nonly one field\n")
    with pytest.raises(UserError, match=r"short.csv:2: fewer fields than the header's 2"):
        list(readers.iter_rows(tmp_path / "short.csv"))
    (tmp_path / "obj.json").write_text('{"rows": []}')
    with pytest.raises(UserError, match=r"obj.json:1: expected a JSON array of row objects"):
        list(readers.iter_rows(tmp_path / "obj.json"))
    (tmp_path / "cut.json").write_text('[\n {"text": "a"},\n {"text": "b"}')
    with pytest.raises(UserError, match=r"cut.json:3: the JSON array is truncated"):
        list(readers.iter_rows(tmp_path / "cut.json"))


def test_recipe_checks_name_the_field(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    cases = {
        "sources:\n  - path: d.jsonl\n    wieght: 2\n": r"sources\[0\]: unknown key\(s\) \['wieght'\]",
        "sources:\n  - path: d.jsonl\n    weight: -1\n": r"sources\[0\].weight must be a number > 0",
        "sources:\n  - path: nope.jsonl\n": r"sources\[0\].path: data file not found",
        "sources:\n  - path: d.jsonl\n    format: chatml\n": r"sources\[0\].format='chatml' is not one of",
        "sources:\n  - path: d.jsonl\n    hub: a/b\n": r"needs exactly one of 'path' .* or 'hub'",
    }
    for i, (text, pattern) in enumerate(cases.items()):
        p = tmp_path / f"r{i}.yaml"
        p.write_text(text)
        with pytest.raises(UserError, match=pattern):
            load_recipe(str(p))


def test_hub_source_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"hub dataset 'org/data': the hub is not reachable here"):
        list(readers.iter_rows(source("x", hub="org/data")))
