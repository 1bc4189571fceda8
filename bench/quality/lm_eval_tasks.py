"""Two small local lm-evaluation-harness tasks (bench/quality/lm_eval.py): their data and YAML.

- `nanoflex_capitals`: multiple choice scored by loglikelihood, "What is the capital of X?"
  over four cities, 3 few-shot examples (every question shares that prefix).
- `nanoflex_arith`: `generate_until` a newline, "a + b =", exact match.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = {"nanoflex_capitals": "acc", "nanoflex_arith": "exact_match"}
"""Task -> the metric compared."""

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Russia", "Moscow"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Turkey", "Ankara"),
    ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Australia", "Canberra"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Cuba", "Havana"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Nigeria", "Abuja"), ("Ghana", "Accra"),
    ("Morocco", "Rabat"),
]  # fmt: skip

MC_YAML = """task: nanoflex_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 3
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""

GEN_YAML = """task: nanoflex_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
output_type: generate_until
test_split: test
doc_to_text: "{{{{a}}}} + {{{{b}}}} ="
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: none
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
"""


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tasks(folder: Path, seed: int = 0) -> Path:
    """Write both tasks' data and YAML into `folder` (lm-eval's --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cities = [city for _, city in CAPITALS]
    docs = []
    for country, capital in CAPITALS:
        choices = [capital, *rng.sample([c for c in cities if c != capital], 3)]
        rng.shuffle(choices)
        docs.append({"country": country, "choices": choices, "label": choices.index(capital)})
    train = _jsonl(folder / "capitals_train.jsonl", docs[:5])
    test = _jsonl(folder / "capitals_test.jsonl", docs[5:])
    (folder / "nanoflex_capitals.yaml").write_text(MC_YAML.format(train=train, test=test))
    sums = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(20)]
    rows = [{"a": a, "b": b, "answer": str(a + b)} for a, b in sums]
    arith = _jsonl(folder / "arith_test.jsonl", rows)
    (folder / "nanoflex_arith.yaml").write_text(GEN_YAML.format(test=arith))
    return folder
