"""The built-in dataset: English sentences with spelled-out numbers -> German.

Each example is a short template sentence

    [time adverb] subject verb number [adjective] noun .

translated into German, e.g.

    "yesterday she bought forty-two red apples ."
    -> "gestern kaufte sie zweiundvierzig rote Äpfel ."

Learning it needs what real translation needs, on a vocabulary small enough to
train on two CPU cores in minutes:
  * reordering: German writes units before tens inside one compound word
    ("three hundred forty-two" -> "dreihundertzweiundvierzig"), and a fronted
    adverb moves the verb before the subject (verb-second inversion);
  * subwords: the German number compounds only tokenise into pieces;
  * agreement: the German verb ending follows the subject's number.

Numbers are drawn from 2..9999 so that every noun stays plural.  Sentences are
assigned to train/dev/test by a hash of the English side, so the splits are
disjoint whatever the seed or sizes, and `generate(n, ...)` is a prefix of
`generate(n + k, ...)` for the same seed and split.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

SPLITS = ('train', 'dev', 'test')
MIN_NUMBER = 2
MAX_NUMBER = 9999

# Percent of the sentence space (by hash of the English side) owned by a split.
_SPLIT_HASH_RANGES = {'train': (0, 80), 'dev': (80, 90), 'test': (90, 100)}
_SPLIT_SEED_CODES = {'train': 0, 'dev': 1, 'test': 2}
_CANDIDATES_PER_DRAW = 4096
_ADVERB_PROBABILITY = 0.5
_ADJECTIVE_PROBABILITY = 0.75

_ENGLISH_ONES = (
    'zero one two three four five six seven eight nine ten eleven twelve '
    'thirteen fourteen fifteen sixteen seventeen eighteen nineteen').split()
_ENGLISH_TENS = ('', '', 'twenty', 'thirty', 'forty', 'fifty', 'sixty',
                 'seventy', 'eighty', 'ninety')

# Index 1 is the combining form "ein" (einundzwanzig, einhundert, eintausend).
_GERMAN_UNITS = ('', 'ein', 'zwei', 'drei', 'vier', 'fünf', 'sechs', 'sieben',
                 'acht', 'neun')
_GERMAN_TEENS = ('zehn', 'elf', 'zwölf', 'dreizehn', 'vierzehn', 'fünfzehn',
                 'sechzehn', 'siebzehn', 'achtzehn', 'neunzehn')
_GERMAN_TENS = ('', '', 'zwanzig', 'dreißig', 'vierzig', 'fünfzig', 'sechzig',
                'siebzig', 'achtzig', 'neunzig')

# English -> (German, grammatical number of the subject).
SUBJECTS = {
    'I': ('ich', 'singular'),
    'he': ('er', 'singular'),
    'she': ('sie', 'singular'),
    'we': ('wir', 'plural'),
    'they': ('sie', 'plural'),
    'the farmer': ('der Bauer', 'singular'),
    'my sister': ('meine Schwester', 'singular'),
    'the children': ('die Kinder', 'plural'),
}
# English simple past -> German Präteritum (singular, plural); 1st and 3rd
# person share a form in the German past tense.
VERBS = {
    'bought': ('kaufte', 'kauften'),
    'sold': ('verkaufte', 'verkauften'),
    'saw': ('sah', 'sahen'),
    'found': ('fand', 'fanden'),
    'counted': ('zählte', 'zählten'),
    'painted': ('malte', 'malten'),
    'carried': ('trug', 'trugen'),
}
# Strong plural accusative endings: no article precedes them.
ADJECTIVES = {
    'red': 'rote', 'green': 'grüne', 'big': 'große', 'small': 'kleine',
    'old': 'alte', 'new': 'neue', 'blue': 'blaue', 'yellow': 'gelbe',
}
NOUNS = {
    'apples': 'Äpfel', 'books': 'Bücher', 'chairs': 'Stühle', 'cars': 'Autos',
    'houses': 'Häuser', 'birds': 'Vögel', 'stones': 'Steine', 'cups': 'Tassen',
    'trees': 'Bäume', 'flowers': 'Blumen',
}
ADVERBS = {
    'yesterday': 'gestern', 'today': 'heute', 'last week': 'letzte Woche',
    'in the evening': 'am Abend', 'then': 'dann', 'on sunday': 'am Sonntag',
}


def _check_number_range(n: int) -> None:
  if not 0 <= n <= 999_999:
    raise ValueError(f'can only spell 0..999999, got {n}')


def _english_below_thousand(n: int) -> str:
  hundreds, rest = divmod(n, 100)
  words = [f'{_ENGLISH_ONES[hundreds]} hundred'] if hundreds else []
  if rest >= 20:
    tens, ones = divmod(rest, 10)
    words.append(_ENGLISH_TENS[tens] + (f'-{_ENGLISH_ONES[ones]}' if ones else ''))
  elif rest:
    words.append(_ENGLISH_ONES[rest])
  return ' '.join(words)


def to_english(n: int) -> str:
  """Spells 0 <= n <= 999999 in English words: 342 -> 'three hundred forty-two'."""
  _check_number_range(n)
  if n == 0:
    return 'zero'
  thousands, rest = divmod(n, 1000)
  words = [f'{_english_below_thousand(thousands)} thousand'] if thousands else []
  if rest:
    words.append(_english_below_thousand(rest))
  return ' '.join(words)


def _german_below_thousand(n: int, is_last: bool) -> str:
  """German compound for 1..999; a final lone 1 is 'eins' only if `is_last`."""
  hundreds, rest = divmod(n, 100)
  word = f'{_GERMAN_UNITS[hundreds]}hundert' if hundreds else ''
  if rest == 1:
    word += 'eins' if is_last else 'ein'
  elif rest < 10:
    word += _GERMAN_UNITS[rest]
  elif rest < 20:
    word += _GERMAN_TEENS[rest - 10]
  else:
    tens, units = divmod(rest, 10)
    word += (f'{_GERMAN_UNITS[units]}und' if units else '') + _GERMAN_TENS[tens]
  return word


def to_german(n: int) -> str:
  """Spells 0 <= n <= 999999 as one German word: 342 -> 'dreihundertzweiundvierzig'."""
  _check_number_range(n)
  if n == 0:
    return 'null'
  thousands, rest = divmod(n, 1000)
  word = f'{_german_below_thousand(thousands, is_last=False)}tausend' if thousands else ''
  if rest:
    word += _german_below_thousand(rest, is_last=True)
  return word


@functools.cache
def _spelled_numbers() -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(English, German) spellings indexed by the number itself, up to MAX_NUMBER."""
  numbers = range(MAX_NUMBER + 1)
  return tuple(map(to_english, numbers)), tuple(map(to_german, numbers))


def _draw_numbers(rng: np.random.Generator, size: int) -> np.ndarray:
  """Numbers in [2, 9999] with 2-, 3- and 4-digit magnitudes equally likely."""
  low = np.array([MIN_NUMBER, 100, 1000])
  high = np.array([100, 1000, MAX_NUMBER + 1])
  magnitude = rng.integers(0, 3, size)
  return rng.integers(low[magnitude], high[magnitude])


def sentence_pair(subject: str, verb: str, number: int, noun: str,
                  adjective: str | None = None, adverb: str | None = None
                  ) -> tuple[str, str]:
  """(English, German) sentence from English words, e.g.

  sentence_pair('she', 'bought', 42, 'apples', 'red', 'yesterday') ->
  ('yesterday she bought forty-two red apples .',
   'gestern kaufte sie zweiundvierzig rote Äpfel .')
  """
  english_numbers, german_numbers = _spelled_numbers()
  subject_de, grammatical_number = SUBJECTS[subject]
  verb_de = VERBS[verb][0 if grammatical_number == 'singular' else 1]
  noun_en, noun_de = noun, NOUNS[noun]
  if adjective is not None:
    noun_en, noun_de = f'{adjective} {noun_en}', f'{ADJECTIVES[adjective]} {noun_de}'
  english = f'{subject} {verb} {english_numbers[number]} {noun_en} .'
  object_de = f'{german_numbers[number]} {noun_de} .'
  if adverb is None:
    return english, f'{subject_de} {verb_de} {object_de}'
  return (f'{adverb} {english}',
          f'{ADVERBS[adverb]} {verb_de} {subject_de} {object_de}')


def _draw_candidates(rng: np.random.Generator, size: int) -> list[tuple[str, str]]:
  def draw(words: dict, probability: float = 1.0) -> list:
    choices = list(words) + [None]
    index = rng.integers(0, len(words), size)
    index = np.where(rng.random(size) < probability, index, len(words))
    return [choices[i] for i in index]

  subjects, verbs = draw(SUBJECTS), draw(VERBS)
  numbers = _draw_numbers(rng, size).tolist()
  adjectives = draw(ADJECTIVES, _ADJECTIVE_PROBABILITY)
  nouns = draw(NOUNS)
  adverbs = draw(ADVERBS, _ADVERB_PROBABILITY)
  return list(map(sentence_pair, subjects, verbs, numbers, nouns, adjectives,
                  adverbs))


def split_of(english: str) -> str:
  """The split that owns an English sentence (a stable hash, not Python's)."""
  percent = int.from_bytes(
      hashlib.blake2b(english.encode(), digest_size=8).digest(), 'little') % 100
  for split, (low, high) in _SPLIT_HASH_RANGES.items():
    if low <= percent < high:
      return split
  raise AssertionError(percent)


def generate(num_examples: int, seed: int, split: str) -> list[tuple[str, str]]:
  """`num_examples` distinct (English, German) pairs of `split`, fixed by `seed`."""
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
  rng = np.random.default_rng([seed, _SPLIT_SEED_CODES[split]])
  pairs: list[tuple[str, str]] = []
  seen: set[str] = set()
  while len(pairs) < num_examples:
    for english, german in _draw_candidates(rng, _CANDIDATES_PER_DRAW):
      if english not in seen and split_of(english) == split:
        seen.add(english)
        pairs.append((english, german))
  return pairs[:num_examples]


def number_of(english: str) -> int:
  """The number written out in a built-in English sentence, e.g.
  number_of('she bought forty-two red apples .') -> 42."""
  words = english.split()
  verb_index = next(i for i, word in enumerate(words) if word in VERBS)
  number_words = words[verb_index + 1:-2]  # Drops the noun and the full stop.
  if number_words and number_words[-1] in ADJECTIVES:
    number_words = number_words[:-1]
  return _english_to_number()[' '.join(number_words)]


@functools.cache
def _english_to_number() -> dict[str, int]:
  return {english: n for n, english in enumerate(_spelled_numbers()[0])}


def task_examples(dataset: str, num_examples: int, seed: int, split: str
                  ) -> list[tuple[str, str]]:
  """(English sentence, label) pairs of the built-in sentences for other tasks:

    'number_parity': label 'even' or 'odd' (classification);
    'number_value':  the number / MAX_NUMBER, in [0, 1] (regression);
    'sentences':     label '' (language modelling over the English side).
  """
  english = [pair[0] for pair in generate(num_examples, seed, split)]
  if dataset == 'sentences':
    return [(sentence, '') for sentence in english]
  numbers = [number_of(sentence) for sentence in english]
  if dataset == 'number_parity':
    return [(s, 'odd' if n % 2 else 'even') for s, n in zip(english, numbers)]
  if dataset == 'number_value':
    return [(s, f'{n / MAX_NUMBER:.6f}') for s, n in zip(english, numbers)]
  raise ValueError(f'data.builtin.dataset={dataset!r} is not one of '
                   "('translation', 'number_parity', 'number_value', 'sentences')")
