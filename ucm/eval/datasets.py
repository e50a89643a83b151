"""Multi-document QA data sets: CacheBlend's JSON, LongBench JSONL, and a generated set.

The generated set exists because nothing may be downloaded at run time: each question asks for a
fact that is stated in exactly one passage, the other passages being distractors about other
people, so a small model can answer it from the context and reordering the passages (the
situation CacheBlend is for) does not change the right answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class QAExample:
    passages: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    # Start of the assistant's reply ("X was born in the town of"): small models then answer
    # with the fact itself instead of a sentence around it, which is what F1 measures.
    answer_prefix: str = ""


def load_cacheblend_json(path: Path) -> list[QAExample]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path}: not a readable JSON file: {exc}") from exc
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of {{ctxs, question, answers}} objects")
    examples = []
    for i, item in enumerate(data):
        try:
            passages = tuple(_passage_text(c) for c in item["ctxs"])
            examples.append(QAExample(passages, str(item["question"]), _answers(item["answers"])))
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{path}: item {i} lacks 'ctxs', 'question' or 'answers' ({exc!r})") from exc
    return examples


def _passage_text(ctx) -> str:
    if isinstance(ctx, str):
        return ctx
    title = ctx.get("title") or ""
    return f"{title}\n{ctx['text']}" if title else str(ctx["text"])


def _answers(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    answers = tuple(str(a) for a in value)
    if not answers:
        raise TypeError("empty answers")
    return answers


def load_longbench_jsonl(path: Path, passage_chars: int = 2400) -> list[QAExample]:
    """LongBench rows carry one long `context`; split it into passages at paragraph borders."""
    examples = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: not a readable JSONL file: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            context, question, answers = row["context"], row["input"], _answers(row["answers"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DatasetError(f"{path}:{lineno}: expected JSON with 'context', 'input', 'answers' ({exc!r})") from exc
        examples.append(QAExample(_split_passages(context, passage_chars), question, answers))
    return examples


def _split_passages(context: str, passage_chars: int) -> tuple[str, ...]:
    passages, current = [], ""
    for para in context.split("\n"):
        if current and len(current) + len(para) > passage_chars:
            passages.append(current)
            current = ""
        current = f"{current}\n{para}" if current else para
    if current.strip():
        passages.append(current)
    return tuple(passages)


_FIRST = ["Marta", "Ivo", "Selma", "Tobias", "Lena", "Oskar", "Nadia", "Emil", "Greta", "Felix", "Ilse",
          "Jonas", "Petra", "Rafael", "Vera", "Anton", "Clara", "Dario", "Elsa", "Hugo", "Irma", "Karl",
          "Livia", "Milo", "Nora", "Otto", "Paula", "Rune", "Sofia", "Timo"]
_LAST = ["Kellen", "Brandt", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Alvarez", "Novak", "Duarte",
         "Holm", "Ferrante", "Sato", "Kowalski", "Bergman", "Castillo", "Dubois", "Eriksen", "Fischer",
         "Gallo", "Haddad", "Ivanova", "Jensen", "Keller", "Laine", "Mendes", "Nakamura", "Olsen"]
_CITIES = ["Orvale", "Brackenford", "Lumen Bay", "Quarry Hill", "Westmere", "Tallinford", "Port Ardent",
           "Silverbrook", "Ashcombe", "Redwater", "Elmstead", "Northgate", "Kingsreach", "Thornbury",
           "Marlow Cross", "Greyhaven", "Fallowmere", "Stonebridge", "Willowdene", "Harrowgate"]
_JOBS = ["glassblower", "beekeeper", "cartographer", "violin maker", "lighthouse keeper", "watchmaker",
         "bookbinder", "ferry captain", "stonemason", "perfumer", "clockmaker", "potter", "falconer",
         "blacksmith", "astronomer", "tailor", "locksmith", "baker", "librarian", "shipwright"]
_FILLER = [
    "{n} enjoys long walks in the early morning before anyone else is awake.",
    "On weekends {n} likes to read old novels by the window.",
    "Friends describe {n} as patient, careful and quietly funny.",
    "{n} keeps a small garden with tomatoes, beans and a row of sunflowers.",
    "Every winter {n} knits scarves and gives them away to neighbours.",
    "{n} once spent a whole summer learning to sail a small wooden boat.",
    "In the evenings {n} often plays chess with an old friend from school.",
    "{n} prefers tea to coffee and drinks it without sugar.",
    "A dog named Pepper follows {n} almost everywhere.",
    "{n} writes letters by hand because it feels more personal.",
    "Music has always mattered to {n}, especially slow piano pieces.",
    "{n} collects postcards from places that friends have visited.",
    "Rainy days are the favourite days of {n}, who loves the sound of rain.",
    "{n} cooks a large soup every Sunday and shares it with the family.",
    "Now and then {n} repairs bicycles for the children of the street.",
    "{n} has kept a diary every single day for many years.",
    "The favourite season of {n} is autumn, when the leaves turn red.",
    "{n} tries to learn one new word in a foreign language each day.",
    "Long train journeys make {n} happy, with a book and a window seat.",
    "{n} volunteers at the local museum on the first Saturday of each month.",
]
_FACTS = {  # statement, question, answer prefix
    "city": ("{n} was born in the town of {v}.", "In which town was {n} born?", "{n} was born in the town of"),
    "job": ("{n} works as a {v}.", "What is the job of {n}?", "{n} works as a"),
}


def generate_synthetic(num_examples: int = 8, passages_per_example: int = 10, passage_words: int = 420,
                       seed: int = 0) -> list[QAExample]:
    """Questions whose answer is stated in exactly one passage among distractor biographies."""
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        names = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], passages_per_example)
        cities = rng.sample(_CITIES, min(passages_per_example, len(_CITIES)))
        jobs = rng.sample(_JOBS, min(passages_per_example, len(_JOBS)))
        passages = []
        for i, name in enumerate(names):
            facts = [_FACTS["city"][0].format(n=name, v=cities[i % len(cities)]),
                     _FACTS["job"][0].format(n=name, v=jobs[i % len(jobs)])]
            passages.append(_biography(rng, name, facts, passage_words))
        target = rng.randrange(passages_per_example)
        kind = rng.choice(sorted(_FACTS))
        value = (cities if kind == "city" else jobs)[target % passages_per_example]
        question, prefix = (t.format(n=names[target]) for t in _FACTS[kind][1:])
        examples.append(QAExample(tuple(passages), question, (value,), prefix))
    return examples


def _biography(rng: random.Random, name: str, facts: list[str], words: int) -> str:
    first = name.split()[0]
    sentences = [f"This is the story of {name}."]
    fillers = [s.format(n=first) for s in _FILLER]
    body: list[str] = []
    while sum(len(s.split()) for s in body) < words:
        rng.shuffle(fillers)
        body.extend(fillers)
    for fact in facts:  # facts early in the passage, where a small model still attends to them
        body.insert(rng.randrange(0, 4), fact)
    sentences.extend(body)
    text, count = [], 0
    for s in sentences:
        text.append(s)
        count += len(s.split())
        if count >= words and all(f in text for f in facts):
            break
    return " ".join(text)


def load_dataset(path: str | Path | None, limit: int | None = None, skip: int = 0,
                 **synthetic_kwargs) -> list[QAExample]:
    """Questions ``skip .. skip + limit`` of a data set by path (format from the suffix and
    content), or of the generated one for None (``skip + limit`` generated unless ``num_examples``
    says otherwise: the end of a longer run, so later questions are held out from earlier runs)."""
    if skip < 0:
        raise DatasetError(f"skip must be >= 0, got {skip}")
    if path is None:
        if limit:
            synthetic_kwargs.setdefault("num_examples", skip + limit)
        examples = generate_synthetic(**synthetic_kwargs)
    else:
        p = Path(path)
        if not p.is_file():
            raise DatasetError(f"data set {p} does not exist or is not a file")
        examples = load_longbench_jsonl(p) if p.suffix == ".jsonl" else load_cacheblend_json(p)
        if not examples:
            raise DatasetError(f"data set {p} holds no examples")
    window = examples[skip:skip + limit] if limit else examples[skip:]
    if not window:
        raise DatasetError(f"skipping {skip} questions leaves none of the data set's {len(examples)}")
    return window
