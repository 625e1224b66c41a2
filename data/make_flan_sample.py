#!/usr/bin/env python3
"""Write ``packer/data/flan_sample.jsonl.gz``: a SYNTHETIC FLAN-style instruction sample.

This is NOT FLAN data and contains no text from the FLAN collection or any other
dataset. Every record is generated here, from word lists, invented pseudo-words
and sentence templates, by a seeded ``random.Random``. Only the *shape* imitates
the FLAN collection on the Hugging Face Hub: each record has the fields

    inputs         the prompt (instruction, optional worked exemplars, the query)
    targets        the expected answer
    task           the task name (about 50 task types: NLI, sentiment, extractive
                   and closed-book QA, summarization, headline and title writing,
                   translation-like rewriting, paraphrase, commonsense choice,
                   arithmetic word problems, code explanation, topic
                   classification, coreference, ...)
    template_type  "zs_opt"/"zs_noopt" (zero-shot) or "fs_opt"/"fs_noopt"
                   (few-shot: several worked exemplars before the query, which
                   is what produces FLAN's long tail of prompt lengths)

How it is made: each task has a generator for one instance (a passage built from
sentence templates, a question, the answer) and several zero-shot templates. A
few-shot record (55%) renders 1-8 exemplars with one template, each followed by
its answer, then the query; exemplars are added until a log-normal character
budget is spent (rarely a "many-shot" prompt with 20-40 exemplars and a larger
budget). Passages have log-normal lengths; summarization tasks occasionally get
a very long document. The knobs are the constants below the imports.

Target length statistics, measured with the Llama 2 tokenizer on
``inputs + "\\n\\n" + targets`` (BOS added by the tokenizer) plus 1 for EOS:
median about 200-300 tokens, mean about 450-500, p99 above 2,000, and a handful
(5-20) of records above 4,096 tokens so over-long policies are exercised.
``--stats`` prints the measured values.

Deterministic: a fixed seed, no dependence on hash order or the clock, and the
gzip stream is written with ``mtime=0`` and an empty file name, so two runs give
byte-identical files.

    python data/make_flan_sample.py [--stats] [--out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys

SEED = 20240611
NUM_RECORDS = 6000
FEW_SHOT_P = 0.55  # share of few-shot records
FS_MU, FS_SIGMA = 8.6, 0.8  # log-normal exemplar budget in characters (median ~5,400)
FS_MAX_CHARS = 11000  # exemplar budget cap for ordinary few-shot prompts
MANY_SHOT_P = 0.006  # rare many-shot prompts (20-40 exemplars) ...
MANY_SHOT_CHARS = 22000  # ... with a larger budget
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DATA = os.path.normpath(os.path.join(HERE, "..", "packer", "data"))  # shipped inside the wheel
DEFAULT_OUT = os.path.join(PACKAGE_DATA, "flan_sample.jsonl.gz")
LLAMA2_TOKENIZER = os.path.join(HERE, "..", "..", "shared", "data", "llama2-tokenizer")  # ../shared/data

# --------------------------------------------------------------------------- words

NOUNS = """river village market teacher garden council engine harbor library farmer
bridge museum forest student doctor window kitchen orchard factory station mountain
island valley painter soldier captain merchant letter journal recipe festival tower
castle meadow desert lantern machine company committee report project program
network signal camera battery vehicle planet comet telescope instrument violin
piano concert theater novel poem song album film director actor audience crowd
neighbor family child parent friend stranger visitor traveler pilot sailor miner
baker butcher carpenter engineer scientist professor lawyer judge senator mayor
governor minister king queen prince castle cottage apartment office hospital school
university college classroom notebook pencil map compass boat ship train airplane
bicycle road highway tunnel canal lake ocean beach cliff cave glacier volcano storm
rain snow wind cloud sunrise sunset season harvest winter summer autumn spring
animal horse dog cat bird eagle owl fox wolf bear deer rabbit fish whale dolphin
insect bee butterfly spider tree flower rose oak pine maple seed root leaf branch
stone metal iron copper silver gold coal oil water fire salt sugar bread cheese
apple orange lemon grape tomato potato carrot onion rice wheat corn coffee tea
market price budget contract agreement policy law rule election vote campaign
debate treaty border army battle victory defeat history century decade museum
language grammar sentence paragraph chapter story legend myth question answer
problem solution method theory experiment sample result error measurement model
computer keyboard screen server database function variable loop array string
message email website browser software hardware robot sensor circuit cable""".split()

ADJECTIVES = """old young ancient modern quiet noisy bright dark small large tiny huge
narrow wide heavy light quick slow careful careless happy sad angry calm brave
shy proud humble honest clever foolish wise strange familiar famous unknown rich
poor busy lazy gentle rough smooth soft hard warm cold hot cool dry wet clean dirty
fresh stale sweet bitter sour salty green red blue yellow purple golden silver
wooden stone iron northern southern eastern western central local national
international rural urban coastal remote crowded empty early late final first
important minor serious simple complex difficult easy useful useless popular rare
common strong weak healthy sick lucky unlucky loyal curious patient eager nervous
generous elegant plain fancy broken steady fragile sturdy distant nearby hidden
obvious silent loud colorful pale vivid sharp dull deep shallow tall short""".split()

VERBS = [  # (base, past, third person)
    ("build", "built", "builds"), ("visit", "visited", "visits"), ("repair", "repaired", "repairs"),
    ("paint", "painted", "paints"), ("study", "studied", "studies"), ("describe", "described", "describes"),
    ("discover", "discovered", "discovers"), ("sell", "sold", "sells"), ("buy", "bought", "buys"),
    ("carry", "carried", "carries"), ("watch", "watched", "watches"), ("follow", "followed", "follows"),
    ("design", "designed", "designs"), ("clean", "cleaned", "cleans"), ("open", "opened", "opens"),
    ("close", "closed", "closes"), ("find", "found", "finds"), ("lose", "lost", "loses"),
    ("write", "wrote", "writes"), ("read", "read", "reads"), ("measure", "measured", "measures"),
    ("protect", "protected", "protects"), ("explore", "explored", "explores"), ("move", "moved", "moves"),
    ("inspect", "inspected", "inspects"), ("praise", "praised", "praises"), ("borrow", "borrowed", "borrows"),
    ("deliver", "delivered", "delivers"), ("photograph", "photographed", "photographs"),
    ("organize", "organized", "organizes"), ("support", "supported", "supports"),
    ("criticize", "criticized", "criticizes"), ("restore", "restored", "restores"),
    ("plant", "planted", "plants"), ("feed", "fed", "feeds"), ("teach", "taught", "teaches"),
    ("cook", "cooked", "cooks"), ("climb", "climbed", "climbs"), ("cross", "crossed", "crosses"),
    ("guard", "guarded", "guards"), ("test", "tested", "tests"), ("fund", "funded", "funds"),
    ("announce", "announced", "announces"), ("celebrate", "celebrated", "celebrates"),
]

ADVERBS = """quickly slowly carefully quietly loudly suddenly eventually finally
rarely often always never gladly reluctantly proudly nervously patiently eagerly
happily sadly calmly boldly gently roughly openly secretly briefly recently""".split()

PREPS = ["near", "beside", "behind", "inside", "outside", "across", "under", "above", "around", "beyond"]
CONNECTIVES = ["However,", "Meanwhile,", "Later,", "As a result,", "In addition,", "Afterwards,",
               "For this reason,", "At the same time,", "Surprisingly,", "In the end,", "Even so,",
               "According to the report,", "By the next morning,", "Over the following weeks,"]
EMOTIONS = ["joy", "sadness", "anger", "fear", "surprise", "love"]
TOPICS = ["World", "Sports", "Business", "Science/Tech"]
DBPEDIA = ["Company", "Educational Institution", "Artist", "Athlete", "Office Holder",
           "Mean Of Transportation", "Building", "Natural Place", "Village", "Animal",
           "Plant", "Album", "Film", "Written Work"]
POS_WORDS = """wonderful excellent delightful superb charming brilliant lovely moving
memorable impressive enjoyable fantastic pleasant satisfying remarkable""".split()
NEG_WORDS = """terrible awful boring dull disappointing tedious clumsy painful bland
forgettable annoying mediocre frustrating confusing dreadful""".split()
SPORTS = ["football", "tennis", "cricket", "rowing", "cycling", "chess", "basketball", "hockey"]
UNITS = [("kilometers", "meters", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
         ("meters", "centimeters", 100), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
         ("days", "hours", 24), ("weeks", "days", 7), ("dozens", "items", 12)]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
ITEMS = ["apples", "books", "pencils", "marbles", "stamps", "tickets", "cookies", "coins",
         "shells", "stickers", "bottles", "cards", "eggs", "flowers", "candles", "blocks"]

ONSETS = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p",
          "pr", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z", "qu", "bl", "cl", "fl", "sl"]
NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "ia", "io", "ee", "oa", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "t", "m", "nd", "rk", "st", "th", "ck", "ng", "x"]
NAME_ENDS = ["a", "o", "el", "an", "ia", "us", "ette", "ine", "ard", "win", "ley", "son"]
PLACE_ENDS = ["ford", "ton", "burg", "vale", "mouth", "field", "haven", "port", "wick", "stead",
              "holm", "by", "moor", "dale", "shire", "bridge", "minster", "well"]
TERM_ENDS = ["ite", "ium", "ase", "ology", "ment", "ism", "ine", "ous", "ic", "ogen", "ar", "ide"]


def _syllable(rng: random.Random) -> str:
    return rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS)


def _pseudo(rng: random.Random, ends: list[str], lo: int, hi: int) -> str:
    return "".join(_syllable(rng) for _ in range(rng.randint(lo, hi))) + rng.choice(ends)


def _unique(rng: random.Random, n: int, ends: list[str], lo: int, hi: int) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        w = _pseudo(rng, ends, lo, hi)
        if w not in seen and len(w) < 16:
            seen.add(w)
            out.append(w)
    return out


class Lexicon:
    """Invented names, places and terms: English-looking, never real data."""

    def __init__(self, rng: random.Random) -> None:
        self.first = [w.capitalize() for w in _unique(rng, 900, NAME_ENDS, 1, 2)]
        self.last = [w.capitalize() for w in _unique(rng, 900, ["", "er", "s", "man", "ley", "wood"], 1, 2)]
        self.places = [w.capitalize() for w in _unique(rng, 1200, PLACE_ENDS, 1, 2)]
        self.orgs = [w.capitalize() for w in _unique(rng, 500, ["co", "tech", "corp", "a", "ex", "ia"], 1, 2)]
        self.terms = _unique(rng, 1500, TERM_ENDS, 1, 3)


# --------------------------------------------------------------------------- text


class Text:
    def __init__(self, rng: random.Random, lex: Lexicon) -> None:
        self.r = rng
        self.lex = lex

    # small pieces
    def name(self) -> str:
        return f"{self.r.choice(self.lex.first)} {self.r.choice(self.lex.last)}"

    def first(self) -> str:
        return self.r.choice(self.lex.first)

    def place(self) -> str:
        return self.r.choice(self.lex.places)

    def org(self) -> str:
        return self.r.choice(self.lex.orgs)

    def term(self) -> str:
        return self.r.choice(self.lex.terms)

    def noun(self) -> str:
        return self.r.choice(NOUNS)

    def adj(self) -> str:
        return self.r.choice(ADJECTIVES)

    def verb(self) -> tuple[str, str, str]:
        return self.r.choice(VERBS)

    def year(self) -> int:
        return self.r.randint(1820, 2023)

    def np(self) -> str:
        r = self.r
        k = r.random()
        if k < 0.4:
            return f"the {self.adj()} {self.noun()}"
        if k < 0.6:
            return f"the {self.noun()} of {self.place()}"
        if k < 0.75:
            return f"a {self.adj()} {self.term()}"
        return f"the {self.noun()}"

    def sentence(self) -> str:
        r = self.r
        v = self.verb()
        k = r.randrange(12)
        if k == 0:
            s = f"{self.name()} {v[1]} {self.np()} {r.choice(PREPS)} {self.np()}."
        elif k == 1:
            s = f"In {self.year()}, {self.np()} in {self.place()} was {self.adj()} and {self.adj()}."
        elif k == 2:
            s = f"Many {self.noun()}s {v[0]} {self.np()} when {self.np()} is {self.adj()}."
        elif k == 3:
            s = f"{r.choice(CONNECTIVES)} {self.np()} {v[1]} {self.np()} {r.choice(ADVERBS)}."
        elif k == 4:
            s = (f"The {self.org()} {self.noun()} {v[2]} {self.np()} every {r.choice(MONTHS)}, "
                 f"and {self.first()} says it is {self.adj()}.")
        elif k == 5:
            s = f"Nobody expected {self.np()} to be so {self.adj()}, but it {v[1]} {self.np()} anyway."
        elif k == 6:
            s = (f"{self.name()}, a {self.adj()} {self.noun()} from {self.place()}, {v[1]} "
                 f"{r.randint(2, 900)} {self.noun()}s in {r.randint(2, 40)} days.")
        elif k == 7:
            s = f"The study of {self.term()} shows that {self.np()} can {v[0]} {self.np()}."
        elif k == 8:
            s = f"{r.choice(CONNECTIVES)} the {self.noun()}s {r.choice(PREPS)} {self.np()} {v[1]} {self.np()}."
        elif k == 9:
            s = (f"\"It was {self.adj()},\" said {self.name()}, who {v[1]} {self.np()} "
                 f"in {self.place()} in {self.year()}.")
        elif k == 10:
            s = f"Because {self.np()} was {self.adj()}, {self.first()} {v[1]} {self.np()} {r.choice(ADVERBS)}."
        else:
            s = f"{self.np().capitalize()} {r.choice(PREPS)} {self.np()} {v[2]} {self.np()}."
        return s[0].upper() + s[1:]

    def paragraph(self, n: int) -> str:
        return " ".join(self.sentence() for _ in range(max(1, n)))

    def document(self, n_sent: int) -> str:
        paras, left = [], n_sent
        while left > 0:
            k = min(left, self.r.randint(3, 7))
            paras.append(self.paragraph(k))
            left -= k
        return "\n\n".join(paras)

    def title(self) -> str:
        k = self.r.randrange(4)
        if k == 0:
            return f"The {self.adj().capitalize()} {self.noun().capitalize()} of {self.place()}"
        if k == 1:
            return f"{self.name()} and the {self.noun().capitalize()}"
        if k == 2:
            return f"{self.org()} {self.verb()[2]} {self.noun().capitalize()} in {self.place()}"
        return f"A {self.adj().capitalize()} {self.term().capitalize()}"

    def n_sent(self, mu: float, sigma: float = 0.6, lo: int = 1, hi: int = 120) -> int:
        return max(lo, min(hi, int(round(self.r.lognormvariate(mu, sigma)))))


# --------------------------------------------------------------------------- tasks
# Each generator returns (fields, target). Templates use str.format on fields;
# "{options}" is filled only by *_opt templates.

def opts_block(options: list[str]) -> str:
    return "OPTIONS:\n" + "\n".join(f"- {o}" for o in options)


TASKS: dict[str, tuple] = {}


def task(name: str, templates: list[str], options: list[str] | None = None, scale: float = 1.0):
    def deco(fn):
        TASKS[name] = (fn, templates, options, scale)
        return fn
    return deco


def _nli(t: Text, mu: float):
    premise = t.paragraph(t.n_sent(mu))
    k = t.r.randrange(3)
    if k == 0:
        hyp, ans = premise.split(". ")[0].rstrip(".") + ".", "yes"
    elif k == 1:
        hyp, ans = f"{t.np().capitalize()} was never {t.adj()}.", "no"
    else:
        hyp, ans = t.sentence(), "it is not possible to tell"
    return {"premise": premise, "hypothesis": hyp}, ans


NLI_T = [
    "{premise}\n\nBased on the paragraph above can we conclude that \"{hypothesis}\"?\n\n{options}",
    "Premise: {premise}\nHypothesis: {hypothesis}\nDoes the premise entail the hypothesis?\n\n{options}",
    "Read the text and determine if the sentence is true:\n\n{premise}\n\nSentence: {hypothesis}\n{options}",
    "{premise}\nCan we infer the following?\n{hypothesis}\n\n{options}",
    "Here is a premise: \"{premise}\"\n\nHere is a hypothesis: \"{hypothesis}\"\n\nIs it possible to conclude that if the premise is true, then so is the hypothesis?\n{options}",
]
NLI_O = ["yes", "it is not possible to tell", "no"]

for _name, _mu in [("anli_r1", 1.9), ("anli_r2", 2.0), ("anli_r3", 2.1), ("rte", 1.5), ("snli", 0.4),
                   ("mnli_matched", 0.9), ("mnli_mismatched", 0.9), ("cb", 1.6), ("qnli", 1.2)]:
    task(_name, NLI_T, NLI_O)(lambda t, _mu=_mu: _nli(t, _mu))


def _review(t: Text, mu: float, labels: tuple[str, str]):
    pos = t.r.random() < 0.5
    words = POS_WORDS if pos else NEG_WORDS
    parts = []
    for _ in range(t.n_sent(mu)):
        if t.r.random() < 0.45:
            parts.append(f"The {t.noun()} was {t.r.choice(words)} and the {t.noun()} felt {t.r.choice(words)}.")
        else:
            parts.append(t.sentence())
    return {"text": " ".join(parts), "title": t.title()}, labels[0] if pos else labels[1]


SENT_T = [
    "{text}\n\nHow would the sentiment of this review be described?\n{options}",
    "Review: {text}\nIs this review positive or negative?\n{options}",
    "Write a one word answer. What is the sentiment of the following text?\n\n{text}\n\n{options}",
    "Title: {title}\nReview: {text}\nDid this reviewer like the product?\n{options}",
]
task("sst2", SENT_T, ["negative", "positive"])(lambda t: _review(t, 0.3, ("positive", "negative")))
task("imdb_reviews", SENT_T, ["negative", "positive"])(lambda t: _review(t, 2.4, ("positive", "negative")))
task("yelp_polarity", SENT_T, ["negative", "positive"])(lambda t: _review(t, 1.7, ("positive", "negative")))
task("amazon_polarity", SENT_T, ["No", "Yes"])(lambda t: _review(t, 1.3, ("Yes", "No")))


@task("emotion", ["Which emotion is expressed in this message?\n\n{text}\n\n{options}",
                  "\"{text}\"\nWhat is the emotion of the speaker?\n{options}"], EMOTIONS)
def _emotion(t: Text):
    e = t.r.choice(EMOTIONS)
    cue = {"joy": "I am so happy that", "sadness": "I feel so low because", "anger": "I am furious that",
           "fear": "I am terrified that", "surprise": "I could not believe that", "love": "I adore how"}[e]
    return {"text": f"{cue} {t.np()} {t.verb()[1]} {t.np()}. {t.sentence()}"}, e


@task("sarcasm", ["Is the following remark sarcastic?\n\n{text}\n\n{options}",
                  "Remark: {text}\nSarcastic or sincere?\n{options}"], ["sarcastic", "sincere"])
def _sarcasm(t: Text):
    s = t.r.random() < 0.5
    text = (f"Oh great, {t.np()} {t.verb()[1]} {t.np()} again. Just what I needed."
            if s else f"I am glad that {t.np()} {t.verb()[1]} {t.np()}.")
    return {"text": text}, "sarcastic" if s else "sincere"


@task("spam_detection", ["Is this message spam?\n\n{text}\n\n{options}",
                         "Message: {text}\nClassify the message as spam or not spam.\n{options}"],
      ["spam", "not spam"])
def _spam(t: Text):
    s = t.r.random() < 0.5
    if s:
        text = (f"CONGRATULATIONS {t.first().upper()}! You have won {t.r.randint(100, 9999)} dollars. "
                f"Reply WIN to claim your {t.adj()} {t.noun()} now!")
    else:
        text = f"Hi {t.first()}, {t.sentence()} See you at the {t.noun()} on {t.r.choice(MONTHS)} {t.r.randint(1, 28)}."
    return {"text": text}, "spam" if s else "not spam"


def _squad(t: Text, mu: float):
    v = t.verb()
    who, obj, where, year = t.name(), f"the {t.adj()} {t.noun()}", t.place(), t.year()
    key = f"In {year}, {who} {v[1]} {obj} in {where}."
    sents = [t.sentence() for _ in range(t.n_sent(mu))]
    sents.insert(t.r.randint(0, len(sents)), key)
    k = t.r.randrange(3)
    q, a = [(f"Who {v[1]} {obj} in {where}?", who), (f"Where did {who} {v[0]} {obj}?", where),
            (f"In what year did {who} {v[0]} {obj}?", str(year))][k]
    return {"context": " ".join(sents), "question": q, "title": t.title()}, a


QA_T = [
    "{context}\n\nAnswer this question based on the article: {question}",
    "Read this and answer the question\n\n{context}\n\n{question}",
    "Title: {title}\n\n{context}\n\nQ: {question}",
    "Answer a question about this article:\n{context}\n{question}",
]
task("squad_v1", QA_T)(lambda t: _squad(t, 2.0))
task("drop", QA_T)(lambda t: _squad(t, 2.4))
task("quac", QA_T)(lambda t: _squad(t, 2.6))


@task("boolq", ["{context}\n\nIs it true that {question}?\n\n{options}",
                "{context}\n\nBased on the passage, {question}?\n{options}"], ["no", "yes"])
def _boolq(t: Text):
    c = t.paragraph(t.n_sent(1.8))
    yes = t.r.random() < 0.5
    noun = t.noun()
    if yes:
        c += f" The {noun} was {t.adj()}."
    return {"context": c, "question": f"the passage mentions a {noun}"}, "yes" if yes else "no"


@task("trivia_qa", ["Answer the following question. {question}", "Trivia question: {question}\nAnswer:",
                    "Q: {question}\nA:"])
def _trivia(t: Text):
    p, term = t.place(), t.term()
    k = t.r.randrange(3)
    if k == 0:
        return {"question": f"Which town is famous for its {t.adj()} {term}?"}, p
    if k == 1:
        return {"question": f"Who first described the {term} of {p}?"}, t.name()
    return {"question": f"In which year was the {t.noun()} of {p} {t.verb()[1]}?"}, str(t.year())


@task("natural_questions", ["Q: {question}?\nA:", "Answer this question:\n\n{question}?"])
def _nq(t: Text):
    return {"question": f"who {t.verb()[1]} the {t.noun()} in {t.place()}"}, t.name()


def _summ(t: Text, mu: float, long_p: float, target_sents: int):
    if t.r.random() < long_p:
        n = t.r.randint(190, 330)
    else:
        n = t.n_sent(mu, 0.65, 3, 160)
    doc = t.document(n)
    return {"text": doc, "title": t.title()}, t.paragraph(target_sents)


SUMM_T = [
    "{text}\n\nWrite highlights for this article.",
    "Article: {text}\n\nSummarize the article above in a few sentences.",
    "Summarize this article:\n\n{text}\n\nSummary:",
    "{text}\nWhat is a short summary of the above article?",
    "Write a summary based on this article:\n\n{text}",
]
task("cnn_dailymail", SUMM_T)(lambda t: _summ(t, 3.3, 0.012, 3))
task("xsum", SUMM_T)(lambda t: _summ(t, 3.0, 0.004, 1))
task("multi_news", SUMM_T)(lambda t: _summ(t, 3.6, 0.012, 4))
task("samsum", ["Summarize this dialogue:\n{text}", "Dialogue:\n{text}\nWhat were the main points in that conversation?"])(
    lambda t: ({"text": "\n".join(f"{t.first()}: {t.sentence()}" for _ in range(t.n_sent(2.2)))}, t.sentence()))


@task("gigaword", ["Write a short summary for this text: {text}", "{text}\n\nWhat is a very short summary of the above text?"])
def _giga(t: Text):
    return {"text": t.paragraph(t.n_sent(0.6))}, t.title().lower()


@task("title_generation", ["Write a title for this article:\n\n{text}", "{text}\n\nWhat would be a good title for this?"])
def _title(t: Text):
    return {"text": t.document(t.n_sent(2.4))}, t.title()


PIG_T = ["Translate to Pig Latin:\n\n{text}", "{text}\n\nRewrite the sentence above in Pig Latin.",
         "How is \"{text}\" said in Pig Latin?"]


def _pig(w: str) -> str:
    core = w.strip(".,\"")
    if not core.isalpha():
        return w
    i = next((j for j, c in enumerate(core) if c.lower() in "aeiou"), 0)
    return w.replace(core, core[i:] + core[:i] + ("way" if i == 0 else "ay"))


@task("wmt_pig_latin", PIG_T)
def _pigl(t: Text):
    s = t.paragraph(t.n_sent(0.5))
    return {"text": s}, " ".join(_pig(w) for w in s.split())


@task("word_reversal", ["Reverse the order of the words in this sentence:\n{text}",
                        "Sentence: {text}\nWrite the words in reverse order."])
def _rev(t: Text):
    s = t.sentence().rstrip(".")
    return {"text": s}, " ".join(reversed(s.split()))


@task("formal_to_casual", ["Rewrite in a casual tone:\n\n{text}", "Make this sound more informal: {text}"])
def _casual(t: Text):
    s = t.sentence()
    return {"text": s}, "so, " + s[0].lower() + s[1:].rstrip(".") + ", you know?"


def _para(t: Text, yes_words: tuple[str, str]):
    s = t.sentence()
    same = t.r.random() < 0.5
    s2 = (f"{t.r.choice(CONNECTIVES)} {s[0].lower()}{s[1:]}" if same else t.sentence())
    return {"s1": s, "s2": s2}, yes_words[0] if same else yes_words[1]


PARA_T = ["Sentence 1: {s1}\nSentence 2: {s2}\nDo these two sentences mean the same thing?\n{options}",
          "\"{s1}\" and \"{s2}\"\n\nAre these paraphrases?\n{options}",
          "Are the following two questions the same?\n{s1}\n{s2}\n\n{options}"]
task("glue_mrpc", PARA_T, ["no", "yes"])(lambda t: _para(t, ("yes", "no")))
task("glue_qqp", PARA_T, ["no", "yes"])(lambda t: _para(t, ("yes", "no")))
task("paws_wiki", PARA_T, ["no", "yes"])(lambda t: _para(t, ("yes", "no")))


@task("paraphrase_generation", ["Paraphrase the following sentence: {text}", "Write a sentence that means the same as: {text}"])
def _paragen(t: Text):
    s = t.sentence()
    return {"text": s}, f"{t.r.choice(CONNECTIVES)} {s[0].lower()}{s[1:]}"


@task("stsb", ["Sentence A: {s1}\nSentence B: {s2}\nRate the similarity of the two sentences from 0 to 5.",
               "How similar are \"{s1}\" and \"{s2}\" on a scale of 0 to 5?"])
def _stsb(t: Text):
    return {"s1": t.sentence(), "s2": t.sentence()}, f"{t.r.randint(0, 50) / 10:.1f}"


def _choice(t: Text, n_opts: int, mu: float):
    goal = f"How do I {t.verb()[0]} {t.np()}?"
    good = f"Use {t.np()} and {t.r.choice(ADVERBS)} {t.verb()[0]} it {t.r.choice(PREPS)} {t.np()}."
    opts = [good] + [f"Use {t.np()} and {t.r.choice(ADVERBS)} {t.verb()[0]} {t.np()}." for _ in range(n_opts - 1)]
    t.r.shuffle(opts)
    ctx = t.paragraph(t.n_sent(mu)) if mu > 0 else ""
    return {"goal": (ctx + "\n" + goal).strip(), "options": opts_block(opts)}, good


CHOICE_T = ["{goal}\n\nChoose the most sensible solution.\n{options}",
            "Goal: {goal}\nWhich of the following methods is more reasonable?\n{options}",
            "Here is a goal: {goal}\n\nHow would you accomplish this goal?\n\n{options}"]
task("piqa", CHOICE_T)(lambda t: _choice(t, 2, 0))
task("hellaswag", CHOICE_T)(lambda t: _choice(t, 4, 1.2))
task("arc_easy", CHOICE_T)(lambda t: _choice(t, 4, 0))
task("arc_challenge", CHOICE_T)(lambda t: _choice(t, 4, 0.5))
task("openbookqa", CHOICE_T)(lambda t: _choice(t, 4, 0.3))


@task("copa", ["Premise: {premise}\nWhat is the {kind}?\n\n{options}",
               "{premise}\n\nWhat was the {kind} of this?\n{options}"])
def _copa(t: Text):
    kind = t.r.choice(["cause", "effect"])
    a, b = t.sentence(), t.sentence()
    return {"premise": t.sentence(), "kind": kind, "options": opts_block([a, b])}, a


@task("story_cloze", ["{text}\n\nWhat is the best ending for this story?\n{options}",
                      "Continue the story.\n\n{text}"])
def _story(t: Text):
    end = f"In the end, {t.first()} {t.verb()[1]} {t.np()}."
    return {"text": t.paragraph(t.n_sent(1.4)), "options": opts_block([end, t.sentence()])}, end


@task("winogrande", ["Fill in the blank: {text}\n\n{options}", "{text}\nWho does the _ refer to?\n{options}"])
def _wino(t: Text):
    a, b = t.first(), t.first()
    text = f"{a} {t.verb()[1]} {t.np()} for {b} because _ was {t.adj()}."
    return {"text": text, "options": opts_block([a, b])}, t.r.choice([a, b])


@task("wsc", ["{text}\n\nIn the previous sentence, does the pronoun \"{pron}\" refer to {who}?\n{options}",
              "Does \"{pron}\" refer to {who} in: {text}\n{options}"], ["no", "yes"])
def _wsc(t: Text):
    a, b = t.first(), t.first()
    pron = t.r.choice(["he", "she", "they"])
    yes = t.r.random() < 0.5
    return ({"text": f"{a} told {b} that {pron} had {t.verb()[1]} {t.np()}.", "pron": pron,
             "who": a if yes else b}, "yes" if yes else "no")


@task("coreference_resolution", ["{text}\n\nWhat does \"it\" refer to in the last sentence?",
                                 "Text: {text}\nResolve the pronoun \"it\"."])
def _coref(t: Text):
    n = t.noun()
    return {"text": f"{t.paragraph(t.n_sent(0.7))} The {n} was {t.adj()}. Later it {t.verb()[1]} {t.np()}."}, f"the {n}"


def _word_problem(t: Text):
    r = t.r
    who, other, item = t.first(), t.first(), r.choice(ITEMS)
    a, b, c = r.randint(3, 60), r.randint(2, 30), r.randint(2, 6)
    k = r.randrange(3)
    if k == 0:
        q = f"{who} has {a} {item}. {other} gives {who} {b} more. How many {item} does {who} have now?"
        steps, ans = f"{who} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b}.", a + b
    elif k == 1:
        q = f"{who} buys {c} boxes of {item} with {b} {item} in each box. How many {item} is that?"
        steps, ans = f"There are {c} boxes with {b} each, so {c} * {b} = {c * b}.", c * b
    else:
        tot = a + b
        q = f"{who} had {tot} {item} and gave {b} to {other}. Then {who} lost {min(c, a)}. How many are left?"
        steps, ans = (f"After giving away {b}, {who} has {tot} - {b} = {a}. After losing {min(c, a)}, "
                      f"{a} - {min(c, a)} = {a - min(c, a)}."), a - min(c, a)
    return q, steps, ans


@task("gsm_like", ["{question}", "Solve this math problem step by step.\n\n{question}",
                   "Question: {question}\nLet's think step by step."])
def _gsm(t: Text):
    q, steps, ans = _word_problem(t)
    return {"question": q}, f"{steps} The answer is {ans}."


@task("math_dataset_arithmetic", ["What is {a} {op} {b}?", "Calculate {a} {op} {b}.", "Solve: {a} {op} {b} ="])
def _arith(t: Text):
    a, b = t.r.randint(-999, 9999), t.r.randint(1, 999)
    op = t.r.choice(["+", "-", "*"])
    return {"a": a, "b": b, "op": op}, str(a + b if op == "+" else a - b if op == "-" else a * b)


@task("unit_conversion", ["Convert {n} {big} to {small}.", "How many {small} are in {n} {big}?"])
def _units(t: Text):
    big, small, f = t.r.choice(UNITS)
    n = t.r.randint(1, 90)
    return {"n": n, "big": big, "small": small}, f"{n * f} {small}"


@task("date_understanding", ["Today is {month} {day}, {year}. What is the date {k} days later? Answer in the form Month Day, Year.",
                             "If it is {month} {day}, {year} now, what date is it in {k} days?"])
def _date(t: Text):
    import datetime
    d = datetime.date(t.r.randint(1990, 2030), t.r.randint(1, 12), t.r.randint(1, 28))
    k = t.r.randint(1, 60)
    e = d + datetime.timedelta(days=k)
    return ({"month": MONTHS[d.month - 1], "day": d.day, "year": d.year, "k": k},
            f"{MONTHS[e.month - 1]} {e.day}, {e.year}")


CODE_FUNCS = [
    ("total", "def {f}(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s",
     "It adds up all the numbers in the list {arg} and returns the sum."),
    ("largest", "def {f}(xs):\n    best = xs[0]\n    for x in xs[1:]:\n        if x > best:\n            best = x\n    return best",
     "It walks through the list {arg} and returns the largest element."),
    ("count_even", "def {f}(xs):\n    return sum(1 for x in xs if x % 2 == 0)",
     "It counts how many numbers in the list {arg} are even."),
    ("reverse", "def {f}(s):\n    return s[::-1]",
     "It returns the string {arg} reversed, using slicing with a step of -1."),
    ("dedupe", "def {f}(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out",
     "It removes duplicates from {arg} while keeping the first occurrence of each element in order."),
]


@task("code_explanation", ["Explain what this Python function does:\n\n```python\n{code}\n```",
                           "```python\n{code}\n```\n\nDescribe the function above in plain English.",
                           "What does the following code do?\n{code}"])
def _code(t: Text):
    _, code, expl = t.r.choice(CODE_FUNCS)
    f = f"{t.term()}_{t.noun()}"
    arg = "xs" if "xs" in code else "s"
    return {"code": code.format(f=f)}, f"The function {f} takes {arg}. " + expl.format(arg=arg)


@task("code_output", ["What does this program print?\n\n```python\n{code}\n```",
                      "Predict the output:\n{code}"])
def _codeout(t: Text):
    xs = [t.r.randint(0, 50) for _ in range(t.r.randint(3, 8))]
    v = t.term()
    return {"code": f"{v} = {xs}\nprint(sum({v}) - min({v}))"}, str(sum(xs) - min(xs))


@task("ag_news_subset", ["{text}\n\nWhich topic is this article about?\n{options}",
                         "Select your answer: Which is this about?\n\n{text}\n\n{options}"], TOPICS)
def _agnews(t: Text):
    topic = t.r.choice(TOPICS)
    cue = {"World": f"The minister of {t.place()} met leaders from {t.place()}.",
           "Sports": f"The {t.place()} {t.r.choice(SPORTS)} team won {t.r.randint(1, 9)} to {t.r.randint(0, 8)}.",
           "Business": f"Shares of {t.org()} rose {t.r.randint(1, 30)} percent on Monday.",
           "Science/Tech": f"Researchers at {t.org()} unveiled a {t.adj()} {t.term()} sensor."}[topic]
    return {"text": cue + " " + t.paragraph(t.n_sent(0.8))}, topic


@task("dbpedia_14", ["{text}\nGiven a list of categories, what category does the paragraph belong to?\n{options}",
                     "Pick one category for the following text. {options}\n\n{text}"], DBPEDIA)
def _dbp(t: Text):
    cat = t.r.choice(DBPEDIA)
    return {"text": f"{t.title()} is a {cat.lower()} in {t.place()}. {t.paragraph(t.n_sent(0.7))}"}, cat


@task("cola", ["Is the following sentence linguistically acceptable?\n{text}\n{options}",
               "\"{text}\"\nWould a linguist rate this sentence acceptable?\n{options}"], ["unacceptable", "acceptable"])
def _cola(t: Text):
    s = t.sentence()
    ok = t.r.random() < 0.6
    if not ok:
        w = s.split()
        t.r.shuffle(w)
        s = " ".join(w)
    return {"text": s}, "acceptable" if ok else "unacceptable"


@task("grammar_correction", ["Correct the grammar in this sentence: {text}", "Fix any mistakes:\n{text}"])
def _gec(t: Text):
    s = t.sentence()
    return {"text": s.replace(" the ", " teh ", 1).replace(" was ", " were ", 1)}, s


@task("word_sorting", ["Sort the following words alphabetically: {text}", "List: {text}\nSorted:"])
def _sort(t: Text):
    w = [t.noun() if t.r.random() < 0.5 else t.term() for _ in range(t.r.randint(4, 15))]
    return {"text": " ".join(w)}, " ".join(sorted(w))


@task("letter_counting", ["How many times does the letter \"{c}\" appear in \"{w}\"?", "Count the letter {c} in the word {w}."])
def _letters(t: Text):
    w = t.term()
    c = t.r.choice(sorted(set(w)))
    return {"w": w, "c": c}, str(w.count(c))


@task("keyword_extraction", ["Extract the keywords from this text:\n\n{text}", "{text}\n\nWhat are the key concepts?"])
def _kw(t: Text):
    text = t.paragraph(t.n_sent(1.5))
    kws = sorted({w.strip(".,\"").lower() for w in text.split() if w.strip(".,\"").lower() in set(NOUNS)})[:6]
    return {"text": text}, ", ".join(kws) or t.noun()


@task("dialog_next_turn", ["Continue the conversation.\n\n{text}", "{text}\n\nWhat might the next reply be?"])
def _dialog(t: Text):
    a, b = t.first(), t.first()
    lines = [f"{a if i % 2 == 0 else b}: {t.sentence()}" for i in range(t.n_sent(1.3))]
    return {"text": "\n".join(lines)}, t.sentence()


@task("question_generation", ["{text}\n\nGenerate a question about the above context.",
                              "Write a question whose answer is in this passage:\n{text}"])
def _qgen(t: Text):
    f, q = _squad(t, 1.2)
    return {"text": f["context"]}, f["question"]


@task("antonyms", ["What is the opposite of \"{w}\"?", "Give an antonym for the word {w}."])
def _ant(t: Text):
    pairs = [("old", "young"), ("quiet", "noisy"), ("bright", "dark"), ("small", "large"), ("narrow", "wide"),
             ("quick", "slow"), ("happy", "sad"), ("rich", "poor"), ("soft", "hard"), ("warm", "cold"),
             ("clean", "dirty"), ("early", "late"), ("strong", "weak"), ("deep", "shallow"), ("tall", "short")]
    a, b = t.r.choice(pairs)
    if t.r.random() < 0.5:
        a, b = b, a
    return {"w": a}, b


@task("fever_fact_check", ["Claim: {claim}\nEvidence: {text}\nIs the claim supported?\n{options}",
                           "{text}\n\nDoes the text support the claim \"{claim}\"?\n{options}"],
      ["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"])
def _fever(t: Text):
    f, ans = _nli(t, 1.3)
    lab = {"yes": "SUPPORTS", "no": "REFUTES"}.get(ans, "NOT ENOUGH INFO")
    return {"claim": f["hypothesis"], "text": f["premise"]}, lab


@task("recipe_generation", ["Write a recipe for {title}.", "Give step by step instructions to make {title}."])
def _recipe(t: Text):
    steps = [f"{i + 1}. {t.verb()[0].capitalize()} the {t.noun()} {t.r.choice(ADVERBS)} {t.r.choice(PREPS)} the {t.noun()}."
             for i in range(t.r.randint(3, 12))]
    return {"title": f"{t.adj()} {t.term()} with {t.noun()}"}, "\n".join(steps)


@task("story_generation", ["Write a short story about {topic}.", "Tell me a story that involves {topic}."])
def _storygen(t: Text):
    return {"topic": f"{t.name()} and {t.np()}"}, t.document(t.n_sent(2.2))


@task("essay_writing", ["Write an essay on the following topic: {topic}", "Compose a few paragraphs about {topic}."])
def _essay(t: Text):
    return {"topic": f"the role of {t.term()} in {t.place()}"}, t.document(t.n_sent(2.9))


# --------------------------------------------------------------------------- records


def _fill(template: str, fields: dict, options: list[str] | None, with_opts: bool) -> str:
    f = dict(fields)
    if "options" not in f:  # multiple-choice tasks bring their own options block
        f["options"] = opts_block(options) if (options and with_opts) else ""
    out = template.format(**f)
    return "\n".join(line.rstrip() for line in out.split("\n")).strip()


def make_record(t: Text, name: str) -> dict:
    fn, templates, options, _ = TASKS[name]
    r = t.r
    few = r.random() < FEW_SHOT_P
    with_opts = options is None or r.random() < 0.8
    tpl = r.choice(templates)
    if not few:
        fields, target = fn(t)
        inputs = _fill(tpl, fields, options, with_opts)
    else:
        # FLAN packs exemplars up to a length budget; here the budget (in
        # characters) is log-normal, and rarely a "many-shot" prompt is allowed.
        many = r.random() < MANY_SHOT_P
        k = r.randint(20, 40) if many else r.randint(1, 8)
        budget = MANY_SHOT_CHARS if many else min(FS_MAX_CHARS, r.lognormvariate(FS_MU, FS_SIGMA))
        shots, used = [], 0
        for _ in range(k):
            f, a = fn(t)
            shot = _fill(tpl, f, options, with_opts) + "\n" + a
            if shots and used + len(shot) > budget:
                break
            shots.append(shot)
            used += len(shot)
        fields, target = fn(t)
        inputs = "\n\n".join(shots + [_fill(tpl, fields, options, with_opts)])
    ttype = ("fs" if few else "zs") + ("_opt" if with_opts and "{options}" in tpl else "_noopt")
    return {"inputs": inputs, "targets": target, "task": name, "template_type": ttype}


def generate(n: int = NUM_RECORDS, seed: int = SEED) -> list[dict]:
    lex = Lexicon(random.Random(seed + 1))
    rng = random.Random(seed)
    t = Text(rng, lex)
    names = list(TASKS)  # definition order: deterministic
    weights = [TASKS[k][3] for k in names]
    recs = []
    for _ in range(n):
        name = rng.choices(names, weights)[0]
        rec = make_record(t, name)
        assert rec["inputs"].strip() and rec["targets"].strip(), rec
        recs.append(rec)
    return recs


def write(recs: list[dict], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        for rec in recs:
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
    os.replace(tmp, path)


def stats(recs: list[dict]) -> None:
    print(f"records: {len(recs)}")
    print(f"tasks:   {len({r['task'] for r in recs})}")
    if not os.path.isdir(LLAMA2_TOKENIZER):
        print(f"Llama 2 tokenizer not found at {LLAMA2_TOKENIZER}; skipping token statistics")
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(LLAMA2_TOKENIZER)
    texts = [r["inputs"] + "\n\n" + r["targets"] for r in recs]
    lens = sorted(len(ids) + 1 for ids in tok(texts)["input_ids"])  # BOS from the tokenizer, +1 EOS
    n = len(lens)
    print("tokens (Llama 2, BOS + inputs\\n\\ntargets + EOS):")
    print(f"  median {statistics.median(lens):.0f}  mean {statistics.fmean(lens):.1f}  "
          f"p90 {lens[int(0.90 * n)]}  p99 {lens[int(0.99 * n)]}  max {lens[-1]}  "
          f"min {lens[0]}  >4096: {sum(x > 4096 for x in lens)}  total {sum(lens)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--stats", action="store_true", help="print length statistics (Llama 2 tokenizer)")
    args = ap.parse_args(argv)
    recs = generate()
    write(recs, args.out)
    print(f"wrote {len(recs)} records to {args.out} ({os.path.getsize(args.out):,} bytes)")
    if args.stats:
        stats(recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
