"""The long-context retrieval task: a code stated once in a few thousand tokens, asked for at the end.

    python scripts/make_data.py      # writes data_recipes/data/needle_{train,validation,eval}.jsonl
    python -m workbench data.recipe=needle_sft data.seq_len=4096 "eval.tasks=[needle_val]"

A row is a station log: short sentences about fictional stations ("Station Korvel logged light
rain at noon."), among them six facts "The access code of Station X is NNNN." for six different
stations, and at the end a question about one of them. The answer is its 4-digit code, exact
match (`eval.tasks=[needle]`). Logs run from LOW to HIGH words (about 1,600-3,300 SmolLM2 tokens), and
the asked fact sits anywhere in them; the other five codes are the distractors.

Roles are split by station, not by row: the station names are dealt into train, validation and
test with a fixed seed, and every station a row mentions (asked, distractor or filler) comes
from its role's pool. So no held-out station appears in any training row in any form;
`role_overlaps` checks that on the shipped files.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

ONSETS = ("Kor", "Vel", "Tam", "Bri", "Sol", "Mar", "Dun", "Ash", "Fen", "Gal", "Hol", "Ish", "Jor", "Lun",
          "Nor", "Ost", "Pel", "Quin", "Rav", "Tor")
CODAS = ("vel", "den", "mir", "stad", "wick", "ton", "ra", "lis", "gard", "mont", "ford", "sk")
NAMES = [o + c for o in ONSETS for c in CODAS]  # 240 station names
SHARES = {"train": 0.6, "validation": 0.2, "test": 0.2}
FACTS = 6
LOW, HIGH = 1200, 2400  # words per log
SIZES = {"train": 200, "validation": 100, "test": 200}  # rows per role

WEATHER = ("light rain", "heavy rain", "fog", "clear skies", "snow", "hail", "strong wind", "a calm sea")
TIMES = ("at dawn", "at noon", "in the evening", "after midnight", "before the shift change", "all day")
EVENTS = ("logged {w} {t}.", "reported {w} {t}.", "sent a supply request {t}.", "repaired a radio mast {t}.",
          "counted {n} boats in the harbour {t}.", "recorded a temperature of {n} degrees {t}.",
          "changed its night crew {t}.", "raised a storm flag {t}.")
QUESTION = "What is the access code of Station {name}? Answer with the code only."
_FACT = re.compile(r"The access code of Station (\w+) is (\d{4})\.")
_ASKED = re.compile(r"What is the access code of Station (\w+)\?")


def pools(seed: str = "needle-names") -> dict[str, list[str]]:
    """The station names of each role: disjoint, a fixed shuffle of NAMES."""
    names = sorted(NAMES)
    random.Random(seed).shuffle(names)
    n_train = int(len(names) * SHARES["train"])
    n_val = int(len(names) * SHARES["validation"])
    return {"train": names[:n_train], "validation": names[n_train:n_train + n_val], "test": names[n_train + n_val:]}


def log_row(rng: random.Random, names: list[str]) -> tuple[str, str, str]:
    """(prompt, answer, asked station): one log of LOW-HIGH words with FACTS facts."""
    stations = rng.sample(names, FACTS)
    codes = rng.sample(range(1000, 10000), FACTS)
    words = rng.randint(LOW, HIGH)
    sentences, n = [], 0
    while n < words:
        s = f"Station {rng.choice(names)} " + rng.choice(EVENTS).format(
            w=rng.choice(WEATHER), t=rng.choice(TIMES), n=rng.randint(2, 40))
        sentences.append(s)
        n += len(s.split())
    for station, code in zip(stations, codes):
        sentences.insert(rng.randint(0, len(sentences)), f"The access code of Station {station} is {code}.")
    asked = rng.randrange(FACTS)
    prompt = " ".join(sentences) + "\n\n" + QUESTION.format(name=stations[asked])
    return prompt, str(codes[asked]), stations[asked]


def files() -> dict[str, list[dict]]:
    """The shipped files: SFT chat rows for training, prompt/answer rows for validation and test."""
    out = {}
    for role, names in pools().items():
        rng = random.Random(f"needle-{role}")
        rows = [log_row(rng, names) for _ in range(SIZES[role])]
        if role == "train":
            out["needle_train.jsonl"] = [{"messages": [{"role": "user", "content": p},
                                                       {"role": "assistant", "content": a}]} for p, a, _ in rows]
        else:
            name = "needle_eval.jsonl" if role == "test" else "needle_validation.jsonl"
            out[name] = [{"prompt": [{"role": "user", "content": p}], "answer": a} for p, a, _ in rows]
    return out


def stations_of(row: dict) -> set[str]:
    """Every station a shipped row names: its facts' and its question's (filler ones among them)."""
    msgs = row.get("messages") or row.get("prompt")
    text = " ".join(m["content"] for m in msgs)
    return set(re.findall(r"Station (\w+)", text))


def role_overlaps(data_dir) -> list[tuple[str, str, int]]:
    """Pairs of needle files in different roles that share a station: (file, other file, how many)."""
    seen = {}
    for path in sorted(Path(data_dir).glob("needle_*.jsonl")):
        seen[path.name] = set().union(*(stations_of(json.loads(line)) for line in path.open() if line.strip()))
    names = sorted(seen)
    return [(a, b, len(seen[a] & seen[b])) for i, a in enumerate(names) for b in names[i + 1:]
            if seen[a] & seen[b]]
