"""A parallel corpus from the system's gettext catalogs: English msgids and
their human translations (msgstrs) in one language, as train/dev/test TSV
files that `configs/tsv_example.py` reads.

  python3 benchmarks/gettext_corpus.py --lang fr --out data/gettext-fr

Every Debian machine holds such text: /usr/share/locale/<lang>/LC_MESSAGES/
*.mo, one catalog per package. Cleanup, in order:
  * the header entry (msgid '') and untranslated entries (empty msgstr) are
    dropped; compiled catalogs hold no fuzzy entries (msgfmt leaves them out
    unless told otherwise), so none are read;
  * a message context ('ctx\\x04msgid') is removed from the source;
  * a plural entry gives one pair: the singular msgid with form 0;
  * whitespace runs (newlines, tabs) become one space;
  * a keyboard accelerator ('_File', 'Save _As', '&Open') is removed when
    the source has exactly one '_' or '&' before a letter and the target
    has at most one (then removed there too);
  * pairs whose source has no letter, or is longer than --max_chars, or
    that hold no text after cleanup, are dropped.
Deduplication: one pair per source sentence; where catalogs translate it
differently, the most frequent translation wins (ties: the first in sorted
order). The split is by source: each source's SHA-1 places it, so no test
or dev source occurs in train, and the split does not depend on the order
in which files are read. Prints the sizes and the copy-the-source baseline
(BLEU and chrF of the untranslated source against the test references).
"""
import argparse
import collections
import glob
import gettext
import hashlib
import os
import re
import sys

import sacrebleu

ACCELERATOR = re.compile(r'(?<![_&])[_&](?=[^\W\d_])')
WHITESPACE = re.compile(r'\s+')
LETTER = re.compile(r'[^\W\d_]')


def catalog_pairs(path: str) -> list[tuple[str, str]]:
  """The (msgid, msgstr) pairs of one compiled catalog (.mo), uncleaned;
  plural entries give (singular msgid, form 0)."""
  with open(path, 'rb') as f:
    catalog = gettext.GNUTranslations(f)._catalog  # pylint: disable=protected-access
  pairs = []
  for key, target in catalog.items():
    if isinstance(key, tuple):
      key, form = key
      if form != 0:
        continue
    pairs.append((key, target))
  return pairs


def strip_accelerator(source: str, target: str) -> tuple[str, str]:
  """Removes one keyboard-accelerator mark from both sides (see the module
  docstring); anything else is returned unchanged."""
  marks = ACCELERATOR.findall(source)
  if len(marks) != 1 or len(ACCELERATOR.findall(target)) > 1:
    return source, target
  return ACCELERATOR.sub('', source), ACCELERATOR.sub('', target)


def clean_pair(source: str, target: str,
               max_chars: int) -> tuple[str, str] | None:
  """The cleaned pair, or None when it is dropped."""
  source = source.rpartition('\x04')[2]
  if not source or not target:
    return None
  source = WHITESPACE.sub(' ', source).strip()
  target = WHITESPACE.sub(' ', target).strip()
  source, target = strip_accelerator(source, target)
  if (not source or not target or len(source) > max_chars
      or not LETTER.search(source)):
    return None
  return source, target


def collect(paths: list[str], max_chars: int) -> dict[str, str]:
  """One target per source: the most frequent over all catalogs, ties
  broken by sorted order."""
  counts = collections.defaultdict(collections.Counter)
  for path in paths:
    try:
      raw = catalog_pairs(path)
    except (OSError, UnicodeDecodeError) as e:
      print(f'skipping {path}: {e}', file=sys.stderr)
      continue
    for source, target in raw:
      pair = clean_pair(source, target, max_chars)
      if pair is not None:
        counts[pair[0]][pair[1]] += 1
  return {source: min(targets.items(), key=lambda kv: (-kv[1], kv[0]))[0]
          for source, targets in counts.items()}


def split_by_source(pairs: dict[str, str], dev_size: int, test_size: int,
                    seed: str = '') -> dict[str, list[tuple[str, str]]]:
  """Test, dev and train pairs, placed by the hash of the source; each
  split is sorted by that hash (a deterministic shuffle)."""
  if dev_size + test_size >= len(pairs):
    raise ValueError(f'{len(pairs)} pairs cannot give {test_size} test and '
                     f'{dev_size} dev pairs and leave any for training; lower '
                     '--dev_size/--test_size or add catalogs.')
  def rank(source):
    return hashlib.sha1((seed + source).encode()).hexdigest()
  ordered = sorted(pairs.items(), key=lambda kv: rank(kv[0]))
  return {'test': ordered[:test_size],
          'dev': ordered[test_size:test_size + dev_size],
          'train': ordered[test_size + dev_size:]}


def copy_baseline(pairs: list[tuple[str, str]]) -> dict[str, float]:
  """BLEU and chrF (sacrebleu defaults) of the source taken as its own
  translation."""
  sources = [s for s, _ in pairs]
  references = [[t for _, t in pairs]]
  return {'bleu': sacrebleu.corpus_bleu(sources, references).score,
          'chrf': sacrebleu.corpus_chrf(sources, references).score}


def write_tsv(path: str, pairs: list[tuple[str, str]]) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    for source, target in pairs:
      f.write(f'{source}\t{target}\n')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--lang', default='fr',
                      help="target language: the locale directory's name "
                      "(fr, es, pt_BR, ...)")
  parser.add_argument('--locale_dir', default='/usr/share/locale')
  parser.add_argument('--out', required=True, help='output directory')
  parser.add_argument('--dev_size', type=int, default=1000)
  parser.add_argument('--test_size', type=int, default=1000)
  parser.add_argument('--max_chars', type=int, default=200,
                      help='longest source kept, in characters')
  parser.add_argument('--seed', default='',
                      help='text mixed into the hash: another split')
  args = parser.parse_args(argv)
  paths = sorted(glob.glob(os.path.join(args.locale_dir, args.lang,
                                        'LC_MESSAGES', '*.mo')))
  if not paths:
    print(f'No catalogs in {args.locale_dir}/{args.lang}/LC_MESSAGES/*.mo; '
          'choose a --lang that is a directory there (ls '
          f'{args.locale_dir}).', file=sys.stderr)
    return 1
  pairs = collect(paths, args.max_chars)
  try:
    splits = split_by_source(pairs, args.dev_size, args.test_size, args.seed)
  except ValueError as e:
    print(e, file=sys.stderr)
    return 1
  os.makedirs(args.out, exist_ok=True)
  for name, rows in splits.items():
    write_tsv(os.path.join(args.out, f'{name}.tsv'), rows)
  same = sum(s == t for s, t in pairs.items())
  print(f'{len(paths)} catalogs in {args.locale_dir}/{args.lang}: '
        f'{len(pairs)} distinct sources ({100 * same / len(pairs):.1f}% '
        'translated unchanged)')
  for name, rows in splits.items():
    print(f'  {name}: {len(rows)} pairs -> '
          f'{os.path.join(args.out, name + ".tsv")}')
  baseline = copy_baseline(splits['test'])
  print(f'copy-the-source baseline on test: BLEU {baseline["bleu"]:.2f}  '
        f'chrF {baseline["chrf"]:.2f}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
