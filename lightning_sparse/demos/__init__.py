"""Small, download-free training tasks used by the examples, the CLI configs and the benchmarks.

- digits (:mod:`~lightning_sparse.demos.digits`): an MLP on scikit-learn's 8x8 digits
  (``pip install "lightning_sparse[examples]"``);
- text (:mod:`~lightning_sparse.demos.text`) and GPT (:mod:`~lightning_sparse.demos.gpt`): next-character
  prediction on the running Python's standard-library source;
- vision (:mod:`~lightning_sparse.demos.vision`): a ResNet-18-shaped CNN with BatchNorm on the digits at 32x32.

Example:
    >>> from lightning_sparse.demos import DigitsClassifier, DigitsDataModule
    >>> model, data = DigitsClassifier(), DigitsDataModule(batch_size=32)
"""

from lightning_sparse.demos.digits import DigitsClassifier, DigitsDataModule, accuracy, load_digits_tensors
from lightning_sparse.demos.gpt import GPTDataModule, TinyGPT, load_gpt_tensors, warmup_cosine
from lightning_sparse.demos.text import (
    TEXT_CHARS,
    TEXT_TRAIN_FILES,
    TEXT_VAL_FILES,
    TEXT_VOCAB,
    NextCharClassifier,
    TextDataModule,
    char_windows,
    encode_text,
    load_text_tensors,
    stdlib_source,
)
from lightning_sparse.demos.vision import DigitImagesDataModule, ResNetClassifier, load_digit_images

__all__ = [
    "load_digits_tensors",
    "DigitsDataModule",
    "DigitsClassifier",
    "accuracy",
    "TEXT_TRAIN_FILES",
    "TEXT_VAL_FILES",
    "TEXT_CHARS",
    "TEXT_VOCAB",
    "stdlib_source",
    "encode_text",
    "char_windows",
    "load_text_tensors",
    "TextDataModule",
    "NextCharClassifier",
    "load_gpt_tensors",
    "GPTDataModule",
    "warmup_cosine",
    "TinyGPT",
    "load_digit_images",
    "DigitImagesDataModule",
    "ResNetClassifier",
]
