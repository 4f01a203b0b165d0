"""Input pipeline: raw sentence pairs -> SentencePiece ids -> tf.data batches."""

from jaxformer.data.pipeline import default_data_config
from jaxformer.data.pipeline import eval_batches
from jaxformer.data.pipeline import train_batches
from jaxformer.data.sources import DataError
from jaxformer.data.sources import MissingFileError
from jaxformer.data.sources import read_split
from jaxformer.data.tokenizer import BOS_ID
from jaxformer.data.tokenizer import EOS_ID
from jaxformer.data.tokenizer import PAD_ID
from jaxformer.data.tokenizer import UNK_ID
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.data.tokenizer import get_or_train
from jaxformer.data.tokenizer import load_tokenizer
from jaxformer.data.tokenizer import train_tokenizer
