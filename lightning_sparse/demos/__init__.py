"""Small, download-free training tasks used by the examples, the CLI configs and the benchmarks.

The digits task (``lightning_sparse.demos.digits``) uses the 8x8 handwritten digits that
scikit-learn ships inside its wheel (``pip install "lightning_sparse[examples]"``), so nothing is
fetched at run time.

The text task (``lightning_sparse.demos.text``) predicts the next character of Python source code,
read from the ``.py`` files of the Python standard library that runs it
(``sysconfig.get_paths()["stdlib"]``): no extra package, no download. Its data depend on the Python
version (the standard library changes between versions) and, given that and the seed, on nothing
else. ``lightning_sparse.demos.gpt`` trains a small GPT on the same source.

The vision task (``lightning_sparse.demos.vision``) trains a ResNet-18-shaped CNN with BatchNorm,
SGD momentum and weight decay on the same digits, upsampled to 32x32.

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
