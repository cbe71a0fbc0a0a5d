"""The shipped data files are exactly what scripts/make_data.py writes, and no question is in two
roles (train / validation / test) in any wording: operands swapped count as the same question."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.data import arith, needle

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data_recipes" / "data"


def test_shipped_files_match_generator():
    r = subprocess.run([sys.executable, "scripts/make_data.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_canonical_form_ignores_operand_order_only():
    q = arith.canonical
    assert q("What is 27 + 64? Answer with the number only.") == q("What is 64 + 27?") == "+:27,64"
    assert q("What is 3 * 7?") == q("What is 7 * 3?") != q("What is 3 + 7?")
    assert q("What is 1 + 2 + 3?") == q("What is 3 + 1 + 2?") == "+:1,2,3"
    assert q("What is 27 + 64?") != q("What is 27 + 65?")
    assert q("  Name a   colour. ") == "Name a colour."


def keys(data: Path, name: str) -> set[str]:
    return {arith.canonical(arith.question_of(json.loads(line))) for line in (data / name).open()}


# task -> (validation file, test file); every other shipped file trains (arith.role_of)
HELD_OUT = {
    "add2": ("arith_add2_validation.jsonl", "arith_add2_eval.jsonl"),
    "add3": ("arith_add3_validation.jsonl", "arith_add3_eval.jsonl"),
    "mul1": ("arith_mul1_validation.jsonl", "arith_mul1_eval.jsonl"),
    "pairs (DPO/KTO/ORPO/RM)": ("arith_pref_validation.jsonl", "arith_pref_eval.jsonl"),
    "calculator": ("calc_validation.jsonl", "calc_eval.jsonl"),
}
TRAINING = ["arith_add2_train.jsonl", "arith_dpo_train.jsonl", "arith_grpo_train.jsonl", "calc_grpo_train.jsonl",
            "calc_sft_train.jsonl", "calc_sft_direct.jsonl"]


def leaks(data: Path, task: str) -> list[str]:
    """What of the task's validation and test questions is trained on by any method (every
    training file, not only the task's own) or in both held-out roles, by canonical form."""
    val, test = HELD_OUT[task]
    trained = set().union(*(keys(data, f) for f in TRAINING if (data / f).exists()))
    v = keys(data, val) if (data / val).exists() else set()
    t = keys(data, test)
    out = [f"{name}: {len(s & trained)} questions trained on, e.g. {min(s & trained)}"
           for name, s in ((val, v), (test, t)) if s & trained]
    if v & t:
        out.append(f"{val} and {test} share {len(v & t)} questions")
    return out


NEEDLE = ("needle_train.jsonl", "needle_validation.jsonl", "needle_eval.jsonl")  # split by station


def test_every_shipped_file_has_a_role_and_is_checked():
    assert {p.name for p in DATA.glob("*.jsonl")} == ({f for pair in HELD_OUT.values() for f in pair} | set(TRAINING)
                                                     | set(NEEDLE))
    assert [arith.role_of(f) for f in NEEDLE] == ["train", "validation", "test"]
    assert {arith.role_of(f) for f in TRAINING} == {"train"}
    for val, test in HELD_OUT.values():
        assert (arith.role_of(val), arith.role_of(test)) == ("validation", "test")
        assert keys(DATA, val) and keys(DATA, test)


@pytest.mark.parametrize("task", HELD_OUT)
def test_held_out_questions_never_trained_in_any_order(task):
    assert leaks(DATA, task) == []


def test_add2_test_split_is_large_enough():
    """The seed tables compare accuracies on it: 200 distinct questions at least."""
    assert len(keys(DATA, "arith_add2_eval.jsonl")) >= 200


def test_no_two_roles_share_a_question_in_any_file():
    assert arith.role_overlaps(DATA) == []


def test_role_check_catches_swapped_operands(tmp_path):
    """A training row that is a held-out question with its operands swapped is found."""
    held = json.loads((DATA / "arith_add2_eval.jsonl").open().readline())
    a, op, b = held["prompt"][0]["content"].split("?")[0].split()[-3:]
    swapped = arith.chat_example(int(b), int(a), op)
    (tmp_path / "arith_add2_eval.jsonl").write_text(json.dumps(held) + "\n")
    (tmp_path / "mine_train.jsonl").write_text(json.dumps(swapped) + "\n")
    (tmp_path / "mine_validation.jsonl").write_text(json.dumps(arith.eval_example(1, 2, "+")) + "\n")
    found = arith.role_overlaps(tmp_path)
    assert [(x, y, n) for x, y, n, _ in found] == [("arith_add2_eval.jsonl", "mine_train.jsonl", 1)]


@pytest.mark.parametrize("task", ["arith_add2", "arith_add3", "arith_mul1", "arith_pref", "needle"])
def test_eval_tasks_read_the_test_split_and_val_tasks_the_validation_split(task):
    from workbench.evals.hooks import eval_rows, lookup

    first = json.loads((DATA / f"{task}_eval.jsonl").open().readline())
    assert eval_rows(task, 1) == [first]
    assert eval_rows(f"{task}_val", 10**6) == [json.loads(line) for line in (DATA / f"{task}_validation.jsonl").open()]
    assert callable(lookup(f"{task}_val"))


def test_needle_roles_share_no_station():
    assert needle.role_overlaps(DATA) == []
    held = {s for f in NEEDLE[1:] for line in (DATA / f).open() for s in needle.stations_of(json.loads(line))}
    assert len(held) >= 40  # the validation and test pools are in use


def test_needle_check_catches_a_held_out_station_in_training(tmp_path):
    row = json.loads((DATA / "needle_eval.jsonl").open().readline())
    leak = {"messages": [{"role": "user", "content": row["prompt"][0]["content"]},
                         {"role": "assistant", "content": row["answer"]}]}
    (tmp_path / "needle_train.jsonl").write_text((DATA / "needle_train.jsonl").read_text() + json.dumps(leak) + "\n")
    (tmp_path / "needle_eval.jsonl").write_text(json.dumps(row) + "\n")
    assert [(a, b) for a, b, _ in needle.role_overlaps(tmp_path)] == [("needle_eval.jsonl", "needle_train.jsonl")]


def test_needle_answer_is_stated_once_in_its_log():
    for line in (DATA / "needle_eval.jsonl").open():
        row = json.loads(line)
        text = row["prompt"][0]["content"]
        asked = needle._ASKED.search(text).group(1)
        facts = dict(needle._FACT.findall(text))
        assert len(facts) == needle.FACTS and facts[asked] == row["answer"]
