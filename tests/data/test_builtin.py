import pytest

from jaxformer.data import builtin


@pytest.mark.parametrize('number, english', [
    (0, 'zero'),
    (2, 'two'),
    (13, 'thirteen'),
    (21, 'twenty-one'),
    (40, 'forty'),
    (100, 'one hundred'),
    (101, 'one hundred one'),
    (342, 'three hundred forty-two'),
    (1000, 'one thousand'),
    (1017, 'one thousand seventeen'),
    (9999, 'nine thousand nine hundred ninety-nine'),
    (21_500, 'twenty-one thousand five hundred'),
])
def test_to_english(number, english):
  assert builtin.to_english(number) == english


@pytest.mark.parametrize('number, german', [
    (0, 'null'),
    (1, 'eins'),
    (2, 'zwei'),
    (11, 'elf'),
    (12, 'zwölf'),
    (16, 'sechzehn'),
    (17, 'siebzehn'),
    (21, 'einundzwanzig'),
    (30, 'dreißig'),
    (60, 'sechzig'),
    (70, 'siebzig'),
    (77, 'siebenundsiebzig'),
    (100, 'einhundert'),
    (101, 'einhunderteins'),
    (342, 'dreihundertzweiundvierzig'),
    (1000, 'eintausend'),
    (1001, 'eintausendeins'),
    (2016, 'zweitausendsechzehn'),
    (9999, 'neuntausendneunhundertneunundneunzig'),
    (21_000, 'einundzwanzigtausend'),
    (101_101, 'einhunderteintausendeinhunderteins'),
])
def test_to_german(number, german):
  assert builtin.to_german(number) == german


@pytest.mark.parametrize('number', [-1, 1_000_000])
def test_spelling_rejects_numbers_out_of_range(number):
  with pytest.raises(ValueError, match='0..999999'):
    builtin.to_german(number)
  with pytest.raises(ValueError, match='0..999999'):
    builtin.to_english(number)


def test_sentence_pair_moves_the_verb_after_a_fronted_adverb():
  assert builtin.sentence_pair('she', 'bought', 42, 'apples', 'red', 'yesterday') == (
      'yesterday she bought forty-two red apples .',
      'gestern kaufte sie zweiundvierzig rote Äpfel .')
  assert builtin.sentence_pair('the children', 'saw', 3017, 'birds') == (
      'the children saw three thousand seventeen birds .',
      'die Kinder sahen dreitausendsiebzehn Vögel .')


def test_generate_is_deterministic_and_seeded():
  assert builtin.generate(50, seed=0, split='train') == builtin.generate(50, 0, 'train')
  assert builtin.generate(50, seed=0, split='train') != builtin.generate(50, 1, 'train')


def test_generate_extends_a_prefix_when_asked_for_more():
  assert builtin.generate(100, 0, 'dev')[:40] == builtin.generate(40, 0, 'dev')


def test_splits_are_disjoint_and_examples_distinct():
  english = {split: [e for e, _ in builtin.generate(2000, 0, split)]
             for split in builtin.SPLITS}
  for split, sentences in english.items():
    assert len(set(sentences)) == len(sentences) == 2000, split
  assert not set(english['train']) & set(english['test'])
  assert not set(english['train']) & set(english['dev'])
  assert not set(english['dev']) & set(english['test'])


def test_generated_targets_are_sentences_with_several_words():
  pairs = builtin.generate(500, 0, 'test')
  assert all(len(german.split()) >= 4 and german.endswith(' .')
             for _, german in pairs)
  numbers = [len(english.split()) for english, _ in pairs]
  assert min(numbers) >= 5 and max(numbers) > 10


def test_unknown_split_is_rejected():
  with pytest.raises(ValueError, match='split'):
    builtin.generate(10, 0, 'validation')
