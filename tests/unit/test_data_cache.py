"""Tokenisation cache (fingerprinted numpy arrays, no pickle) and data.preview without weights.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_data_cache.py
"""

from __future__ import annotations

import shutil

import numpy as np

from tests.helpers import DATA_ASSETS as ASSETS
from tests.helpers import data_cfg, source, tiny_tokenizer
from workbench.data import chat, pipeline


def test_second_run_reads_the_cache_and_a_change_rebuilds(tmp_path, monkeypatch):
    tokenizer, contract = tiny_tokenizer()
    shutil.copy(ASSETS / "messages.jsonl", tmp_path / "m.jsonl")
    src = source("m.jsonl")
    src.path = tmp_path / "m.jsonl"
    first = pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path))
    assert not first.cached
    entry = tmp_path / "cache" / first.fingerprint
    # the four files and the cache's seal (workbench/core/cache.py), nothing half-written beside it
    assert sorted(p.name for p in entry.iterdir()) == [".complete.json", "ids.npy", "mask.npy", "meta.json",
                                                       "offsets.npy"]
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".lock"]
    np.load(entry / "ids.npy", allow_pickle=False)  # plain arrays: loadable with pickle disabled

    calls = []
    real = chat.tokenize_chats

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(chat, "tokenize_chats", counting)  # what pipeline.tokenise_source calls
    again = pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path))
    assert again.cached and again.fingerprint == first.fingerprint and not calls
    assert list(again.examples) == list(first.examples)
    # a truncated array breaks the seal: the entry is rebuilt, not trusted
    with open(entry / "ids.npy", "r+b") as fh:
        fh.truncate(64)
    rebuilt = pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path))
    assert not rebuilt.cached and list(rebuilt.examples) == list(first.examples)
    calls.clear()
    # the fingerprint covers the bytes of the file and the sequence length
    with open(src.path, "a") as fh:
        fh.write('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n')
    changed = pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path))
    assert calls and not changed.cached and len(changed.examples) == len(first.examples) + 1
    assert pipeline.fingerprint(src, tokenizer, contract, data_cfg(tmp_path, seq_len=128), "assistant") != \
        pipeline.fingerprint(src, tokenizer, contract, data_cfg(tmp_path), "assistant")


def test_preview_renders_masked_samples_without_loading_weights(tmp_path, monkeypatch, capsys):
    from tests.conftest import compose
    from workbench import cli
    from workbench.models import load

    def no_weights(*a, **k):
        raise AssertionError("data.preview loaded model weights")

    monkeypatch.setattr(load, "load_model", no_weights)
    monkeypatch.setattr(load, "build_meta", no_weights)
    cfg = compose(["data.preview=true", "data.preview_samples=2", f"data.cache_dir={tmp_path}"], validate=False)
    res = cli.run_job(cfg)
    out = capsys.readouterr().out
    assert len(res["preview"]) == 2 and out.count("--- sample") == 2
    first = res["preview"][0]["text"]
    # only the answer and end-of-turn are trained: they alone sit between the markers
    assert first.count("⟦") == 1 and first.rstrip().endswith("<|im_end|>⟧")
    assert "What is" in first.split("⟦")[0]


def test_a_long_tokenisation_reports_progress(tmp_path, monkeypatch, capsys):
    """Plain progress lines while a source tokenises (a fake clock makes it 'long')."""
    tokenizer, contract = tiny_tokenizer()
    shutil.copy(ASSETS / "messages.jsonl", tmp_path / "m.jsonl")
    src = source("m.jsonl")
    src.path = tmp_path / "m.jsonl"
    ticks = iter(range(0, 10_000, 30))  # every reading of the clock is 30 s later
    real = pipeline._Ticker
    monkeypatch.setattr(pipeline, "_Ticker", lambda label: real(label, clock=lambda: float(next(ticks))))
    monkeypatch.setattr(pipeline, "CHUNK_ROWS", 1)
    out = pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path))
    err = capsys.readouterr().err
    assert "tokenising" in err and f"tokenised {out.rows_read:,} rows" in err


def test_preference_pairs_are_cached_like_sft_sources(tmp_path, monkeypatch):
    """A relaunch or resume of a pair method reads its pairs back (same tokens, labels, prompt
    lengths, margins and counts) instead of tokenising every row again; new bytes rebuild."""
    import json

    from workbench.data import preference
    from workbench.data.recipes import Source

    tokenizer, contract = tiny_tokenizer()
    row = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{**row, "margin": 1.5}, row, {**row, "rejected": "4"},
                                                           {**row, "prompt": "2+3=", "chosen": "5 exactly"}]))
    src = Source(name="p", path=path)
    first = preference.tokenise_preferences(src, tokenizer, contract, data_cfg(tmp_path))
    assert len(first.pairs) == 3 and first.identical == 1
    assert (tmp_path / "cache" / first.fingerprint / ".complete.json").exists()

    def refuse(*a, **k):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(preference, "_tokenise_pairs", refuse)
    again = preference.tokenise_preferences(src, tokenizer, contract, data_cfg(tmp_path))
    assert again.pairs == first.pairs and again.fingerprint == first.fingerprint
    assert (again.identical, again.skipped, again.truncated) == (first.identical, first.skipped, first.truncated)
    assert [p.margin for p in again.pairs] == [1.5, None, None]
    monkeypatch.undo()
    with open(path, "a") as fh:
        fh.write(json.dumps({**row, "prompt": "1+1=", "chosen": "2"}) + "\n")
    changed = preference.tokenise_preferences(src, tokenizer, contract, data_cfg(tmp_path))
    assert len(changed.pairs) == 4 and changed.fingerprint != first.fingerprint
    no_cache = preference.tokenise_preferences(src, tokenizer, contract, data_cfg(tmp_path / "off", cache=False))
    assert no_cache.pairs == changed.pairs and not (tmp_path / "off" / "cache").exists()


def test_unpaired_rows_are_cached_like_pairs(tmp_path, monkeypatch):
    """KTO's unpaired rows (prompt ids, completion ids and labels, desirable or not) come back from
    the cache as tokenised, with their counts; new bytes rebuild; data.cache=false writes nothing."""
    import json

    from workbench.data import unpaired
    from workbench.data.recipes import Source

    tokenizer, contract = tiny_tokenizer()
    rows = [{"prompt": "What is 2 + 2?", "completion": "4", "label": True},
            {"prompt": [{"role": "user", "content": "2+3="}],
             "completion": [{"role": "assistant", "content": "six"}], "label": False},
            {"prompt": "1+1=", "chosen": "2", "rejected": "3"},  # a pair: two rows
            {"prompt": "no label"}]  # bad, skipped under on_bad_row=skip
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = Source(name="u", path=path)
    cfg = data_cfg(tmp_path, on_bad_row="skip")
    first = unpaired.tokenise_unpaired(src, tokenizer, contract, cfg)
    assert [e.label for e in first.examples] == [True, False, True, False] and first.skipped == 1
    assert (tmp_path / "cache" / first.fingerprint / ".complete.json").exists()

    def refuse(*a, **k):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(unpaired, "_tokenise", refuse)
    again = unpaired.tokenise_unpaired(src, tokenizer, contract, cfg)
    assert again.examples == first.examples and again.fingerprint == first.fingerprint
    assert (again.skipped, again.truncated, again.bad) == (first.skipped, first.truncated, first.bad)
    monkeypatch.undo()
    with open(path, "a") as fh:
        fh.write(json.dumps(rows[0]) + "\n")
    changed = unpaired.tokenise_unpaired(src, tokenizer, contract, cfg)
    assert len(changed.examples) == 5 and changed.fingerprint != first.fingerprint
    off = data_cfg(tmp_path / "off", cache=False, on_bad_row="skip")
    no_cache = unpaired.tokenise_unpaired(src, tokenizer, contract, off)
    assert no_cache.examples == changed.examples and not (tmp_path / "off" / "cache").exists()


def test_meta_on_disk_is_scrubbed_of_secrets(tmp_path, monkeypatch):
    """meta.json quotes bad rows and names the source: a token in either never reaches the disk."""
    from workbench.data import cache

    monkeypatch.setenv("HF_TOKEN", "plain-secret-value-1234")
    builder = cache.ArrayBuilder()
    builder.add([1, 2, 3], [-100, 2, 3])
    arrays = builder.build()
    meta = {"skipped": 1, "bad": ["rows.jsonl:3: no 'messages' in {'text': 'hf_" + "a" * 24 + "'}",
                                  "rows.jsonl:4: plain-secret-value-1234 is not a list"]}
    cache.save(tmp_path / "entry", arrays, meta)
    text = (tmp_path / "entry" / "meta.json").read_text()
    assert "hf_" + "a" * 24 not in text and "plain-secret-value-1234" not in text
    _, back = cache.load(tmp_path / "entry")
    assert back["skipped"] == 1 and back["bad"][0].startswith("rows.jsonl:3: no 'messages'")
